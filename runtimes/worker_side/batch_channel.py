"""A `ProcessRuntime`'s batch connection to its child, one attempt at a time.

An attempt sends a batch's (or the model's probe's) frame in its turn on the connection
(`runtimes.worker_side.turns`), reads its replies (a stream's deltas handed on as they
come, each answered with the cancels since) and returns the outcomes, or how it failed
as a `Failure` for the bisection (`runtimes.worker_side.bisection`) to settle: a crash
(the child died; it is replaced through the supervisor), a hang (no reply within
`batch_timeout`: the child is killed) or an exception (the batch raised in the child).

The channel outlives children: a frame made stale by another's failure on the same
connection goes again on the next child. After a failure a call's frames go alone, so
that only a failure with nothing else in flight blames a request. While a failed
restart's next child imports (`RestartPending`, when the runtime does not wait for it),
an attempt's requests are answered MODEL_UNAVAILABLE at once (`unavailable`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from runtimes.base import Delta, OnDeltas, Outcome, Request, failed
from runtimes.wire.frames import (
    BATCH_REPLY_DECODER,
    BatchReply,
    Cancel,
    Deltas,
    Failed,
    Outcomes,
    Probe,
    Run,
    RunOutcome,
    RunRequest,
    StreamDelta,
)
from runtimes.wire.protocol import (
    PROBE_ID,
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    encode_frame,
    recv_frame,
)
from runtimes.worker_side.bisection import Failure
from runtimes.worker_side.runtime_child import RuntimeChild
from runtimes.worker_side.supervisor import RestartPending, Supervisor
from runtimes.worker_side.turns import Stale
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)

# Of these request ids, those whose callers left (read on each step of a stream).
CancelledAmong = Callable[[list[str]], list[str]]


@dataclass(slots=True)
class BatchCall:
    """One `run_batch` call's state through its attempts (its bisection's)."""

    on_deltas: OnDeltas | None
    streamed: set[str] = field(default_factory=set)  # its requests whose deltas went out
    # Failed once: its frames from now on go alone. With another batch in flight a crash
    # fails both, and only a failure with nothing else in flight blames a request.
    alone: bool = False


class BatchChannel:
    """Attempts on the batch connection of whichever child serves now; called from as
    many threads as batches are in flight (each waits for its turn to read)."""

    def __init__(self, children: Supervisor, batch_timeout: float | None,
                 wait_for_restart: bool, cancelled_among: CancelledAmong) -> None:
        self._children = children
        self.batch_timeout = batch_timeout
        self._wait_for_restart = wait_for_restart
        self._cancelled_among = cancelled_among

    def attempt(self, call: BatchCall, model: str, requests: list[Request]
                ) -> list[Outcome] | Failure:
        """Run `requests` once: their outcomes, or how it failed (with the requests of
        theirs whose output went out). After a failure the call's frames go alone; while
        a failed restart's next child imports, they are answered MODEL_UNAVAILABLE."""
        frame = Run(model, [RunRequest(r.id, r.op, r.kwargs, r.stream) for r in requests],
                    call.on_deltas is not None)
        try:
            result = self._exchange(call, frame, [r.id for r in requests])
        except RestartPending as exc:
            return unavailable(call, requests, exc)
        if isinstance(result, Failure):
            call.alone = True
            streamed = call.streamed.intersection(r.id for r in requests)
            if streamed:
                result = dataclasses.replace(result, streamed=frozenset(streamed))
        return result

    def probe(self, model: str) -> str | None:
        """Run the model's probe: None when it was answered, else what went wrong."""
        result = self._exchange(BatchCall(None), Probe(model), [PROBE_ID])
        if isinstance(result, Failure):
            return f"{result.kind}: {result.detail}"
        (outcome,) = result
        if not outcome.ok:
            # A refused probe proves nothing either way (and is a bug in the adapter's probe).
            return f"the probe was refused: {outcome.error_code}: {outcome.error_message}"
        return None

    def _exchange(self, call: BatchCall, frame: Run | Probe, ids: list[str]
                  ) -> list[Outcome] | Failure:
        """Send a run or probe frame; the outcomes (for `ids`, in order) or how it failed.

        Batches from several threads share the connection (the child answers them in
        the order they came, `runtimes.child_side.pipeline`): each waits for its turn to
        read. A frame that talks back (a stream's deltas) or must run alone (a probe)
        waits until nothing else is in flight and keeps the connection for its exchange."""
        try:
            payload = encode_frame(frame)
        except FrameTooLarge as exc:  # nothing was sent; halves may fit
            return Failure("exception", str(exc))
        alone = call.alone or isinstance(frame, Probe) or frame.deltas
        while True:
            child = self._children.ready_child(wait=self._wait_for_restart)
            try:
                return self._send(call, child, payload, alone, ids)
            except Stale as exc:
                # Another frame's failure broke the connection first: on the next child.
                self._children.replace_dead(child, f"connection lost: {exc}")

    def _send(self, call: BatchCall, child: RuntimeChild, payload: bytearray, alone: bool,
              ids: list[str]) -> list[Outcome] | Failure:
        """One frame's exchange on `child` (see `_exchange`)."""
        assert child.sock is not None
        try:
            with child.turns.send(alone) as turn:
                child.sock.settimeout(self.batch_timeout)
                child.sock.sendall(payload)
                if alone:
                    reply = self._converse(call, child, ids)
            if not alone:
                with turn.reading():
                    reply = recv_frame(child.sock, BATCH_REPLY_DECODER)
        except TimeoutError:
            why = f"no answer within the {self.batch_timeout:g}s batch timeout"
            self._children.replace_dead(child, why)
            return Failure("hang", why)
        except Stale:
            raise
        except MalformedFrame as exc:
            self._children.replace_dead(child, "protocol error")
            raise RuntimeError(f"unexpected reply from the model runtime: {exc}") from exc
        except (OSError, EOFError, ProtocolError) as exc:
            return Failure("crash", self._children.replace_dead(child,
                                                                f"connection lost: {exc}"))
        if isinstance(reply, Outcomes):
            return self._outcomes(child, reply.outcomes, ids)
        if isinstance(reply, Failed):
            if reply.fatal:
                how = self._children.replace_dead(child, "fatal device error")
                return Failure("crash", f"{reply.reason}, then {how}")
            return Failure("exception", reply.reason)
        self._children.replace_dead(child, "protocol error")
        raise RuntimeError(f"unexpected reply from the model runtime: {reply!r:.300}")

    def _converse(self, call: BatchCall, child: RuntimeChild, ids: list[str]) -> BatchReply:
        """The replies to a frame sent alone, up to its last: a stream's deltas, each
        answered with the cancels since."""
        assert child.sock is not None
        reply = recv_frame(child.sock, BATCH_REPLY_DECODER)
        while isinstance(reply, Deltas):
            self._forward(call, reply.deltas)
            child.sock.sendall(encode_frame(Cancel(self._cancelled_among(ids))))
            reply = recv_frame(child.sock, BATCH_REPLY_DECODER)
        return reply

    def _forward(self, call: BatchCall, raw: list[StreamDelta]) -> None:
        """Hand a step's deltas to the batch's `on_deltas` (the batch timeout then applies
        to each step, not to the whole stream)."""
        deltas = [Delta(d.id, d.index, d.text, d.tokens) for d in raw]
        call.streamed.update(d.id for d in deltas)
        if call.on_deltas is not None:
            try:
                call.on_deltas(deltas)
            except Exception:  # the worker's side of a stream must not fail the batch
                log.exception("delivering %d deltas failed", len(deltas))

    def _outcomes(self, child: RuntimeChild, raw: list[RunOutcome], ids: list[str]
                  ) -> list[Outcome]:
        outcomes = [Outcome(o.id, o.result, o.error_code, o.error_message, o.stats)
                    for o in raw]
        if [o.id for o in outcomes] != ids:
            self._children.replace_dead(child, "protocol error")
            raise RuntimeError(f"the model runtime answered other requests: {raw!r:.300}")
        return outcomes


def unavailable(call: BatchCall, requests: list[Request], pending: RestartPending
                ) -> list[Outcome]:
    """The outcomes of requests that cannot run until the runtime has restarted."""
    def outcome(request: Request) -> Outcome:
        if request.id in call.streamed:  # its beginning went out: it cannot be retried
            return failed(request.id, ErrorCode.STREAM_INTERRUPTED,
                          f"{pending} (part of this request's output was streamed; "
                          "that part stands)")
        return Outcome(request.id, error_code=str(ErrorCode.MODEL_UNAVAILABLE),
                       error_message=str(pending),
                       stats={"retry_after_s": pending.retry_after_s})
    return [outcome(r) for r in requests]
