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

A batch's first frame may be sent ahead by the worker's loop (`send_ahead`, which never
waits: only a small frame of a batch without streams, to a child that is up, with
nothing in flight), so that the child starts while the batch's thread wakes up; that
thread reads the reply in the frame's turn (`attempt` with the `Ahead`) and settles a
failure exactly as for a frame it sent itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
from tasks.served import give_shared

if TYPE_CHECKING:
    from runtimes.worker_side.turns import Turn

log = logging.getLogger(__name__)

# The largest frame the loop sends ahead: a child that is up and has nothing in flight is
# reading, and the socket's buffer takes this much at once (the loop never waits on it).
AHEAD_MAX_BYTES = 64 * 1024

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


@dataclass(slots=True)
class Ahead:
    """A batch's first frame, sent ahead by the worker's loop (`BatchChannel.send_ahead`);
    its reply is read in `turn` on `child`. `error`: the send raised (the turn is over;
    the batch's thread settles it as a failed send)."""

    child: RuntimeChild
    turn: Turn
    error: BaseException | None = None

    def discard(self) -> None:
        """The batch will never read the reply: the connection is out of step, and the
        next frame on it fails (`Stale`) and goes to the next child."""
        if self.error is None:
            self.child.turns.broken = True
            self.child.turns.done()


class BatchChannel:
    """Attempts on the batch connection of whichever child serves now; called from as
    many threads as batches are in flight (each waits for its turn to read)."""

    def __init__(self, children: Supervisor, batch_timeout: float | None,
                 wait_for_restart: bool, cancelled_among: CancelledAmong) -> None:
        self._children = children
        self.batch_timeout = batch_timeout
        self._wait_for_restart = wait_for_restart
        self._cancelled_among = cancelled_among

    def send_ahead(self, model: str, requests: list[Request]) -> Ahead | None:
        """Send a batch's first frame now, from a thread that must not wait (the worker's
        loop): None, with nothing sent, unless the batch has no stream, its frame is small
        and the current child is up with nothing in flight. The batch's `attempt` with
        the `Ahead` reads the reply."""
        if any(r.stream for r in requests):
            return None
        child = self._children.child
        if child is None or child.sock is None or child.spare or child.proc.poll() is not None:
            return None
        try:
            payload = encode_frame(Run(model, [
                RunRequest(r.id, r.op, r.kwargs, r.stream, r.deadline_ms) for r in requests],
                False, requests[0].trace if requests else None))
        except Exception:  # (FrameTooLarge, say) the batch's thread meets it, as usual
            return None
        if len(payload) > AHEAD_MAX_BYTES:
            return None
        sock, turn = child.sock, None
        try:
            with child.turns.ahead() as turn:
                if turn is None:
                    return None
                sock.settimeout(self.batch_timeout)
                sock.sendall(payload)
        except Exception as exc:
            if turn is None:
                raise
            return Ahead(child, turn, exc)  # its thread settles it (`_reply`), as its own
        return Ahead(child, turn)

    def attempt(self, call: BatchCall, model: str, requests: list[Request],
                ahead: Ahead | None = None) -> list[Outcome] | Failure:
        """Run `requests` once: their outcomes, or how it failed (with the requests of
        theirs whose output went out). After a failure the call's frames go alone; while
        a failed restart's next child imports, they are answered MODEL_UNAVAILABLE.
        `ahead`: the frame was sent ahead (`send_ahead`); its reply is read."""
        frame = Run(model, [RunRequest(r.id, r.op, r.kwargs, r.stream, r.deadline_ms)
                            for r in requests], call.on_deltas is not None,
                    requests[0].trace if requests else None)  # the batch's, traced
        try:
            result = self._exchange(call, frame, [r.id for r in requests], ahead)
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

    def _exchange(self, call: BatchCall, frame: Run | Probe, ids: list[str],
                  ahead: Ahead | None = None) -> list[Outcome] | Failure:
        """Send a run or probe frame; the outcomes (for `ids`, in order) or how it failed.

        Batches from several threads share the connection (the child answers them in
        the order they came, `runtimes.child_side.pipeline`): each waits for its turn to
        read. A frame that talks back (a stream's deltas) or must run alone (a probe)
        waits until nothing else is in flight and keeps the connection for its exchange."""
        if ahead is not None:
            try:
                return self._reply(ahead.child, lambda: self._read_ahead(ahead), ids)
            except Stale as exc:  # (nothing was before it: only if the child was replaced)
                self._children.replace_dead(ahead.child, f"connection lost: {exc}")
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
        sock = child.sock
        assert sock is not None

        def exchange() -> BatchReply:
            with child.turns.send(alone) as turn:
                sock.settimeout(self.batch_timeout)
                sock.sendall(payload)
                if alone:
                    return self._converse(call, child, ids)
            with turn.reading():
                return recv_frame(sock, BATCH_REPLY_DECODER)

        return self._reply(child, exchange, ids)

    @staticmethod
    def _read_ahead(ahead: Ahead) -> BatchReply:
        """The reply to a frame sent ahead, in its turn (or how its send failed)."""
        if ahead.error is not None:
            raise ahead.error
        assert ahead.child.sock is not None
        with ahead.turn.reading():
            return recv_frame(ahead.child.sock, BATCH_REPLY_DECODER)

    def _reply(self, child: RuntimeChild, exchange: Callable[[], BatchReply], ids: list[str]
               ) -> list[Outcome] | Failure:
        """The outcomes of a frame's `exchange` on `child` (its send and its reply), or how
        it failed: a hang, a crash or an exception. Stale goes through."""
        try:
            reply = exchange()
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
            return self._outcomes(child, reply.outcomes, ids, reply.shared)
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

    def _outcomes(self, child: RuntimeChild, raw: list[RunOutcome], ids: list[str],
                  shared: dict | None = None) -> list[Outcome]:
        """The outcomes of a reply, each result whole again (the facts its batch's results
        share came once, as `shared`: the worker's own code reads each result's)."""
        if shared:
            give_shared((o.result for o in raw), shared)
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
