"""A runtime whose models live in a child process, so that the worker survives them.

The child (`python -m runtimes.child_side.server`) is spawned, never forked, and reached
over a private Unix socket with msgpack frames (`runtimes.wire.frames`). A segfault, an
OOM kill, a CUDA error or an exception in the model ends at most that child; the
worker restarts it (`runtimes.worker_side.supervisor`: restarts, the spare, failed starts) and
finds which request is to blame (`runtimes.worker_side.bisection`: the restart and bisect policy,
the probe).

A batch that gets no reply within `batch_timeout` (when one is set) is a
hang: the child is killed and the batch bisected as after a crash. Without
a timeout a hung model blocks the calling thread, and the caller's
deadline is all that ends the wait. After a death the next child is
spawned at once (without waiting for it), so it loads while the batch's
replies go out.

Two batches in flight (`pipeline_depth`, the worker's SHOAL_RUNTIME_PIPELINE_DEPTH):
the child prepares the second while its device computes the first. A crash then
fails both; each is bisected on its own, on the next child, its frames sent alone from
its first failure on (nothing else in flight), so a request is still blamed only for a
failure of its own and every other request gets its result. A streamed batch and a
probe go alone (they talk back and forth on the connection; `runtimes.worker_side.turns`).

A failed restart (`answer_while_restarting`, what the worker sets): when a dead child's
replacement itself fails to start and the next one is still importing, a batch (a
bisection's step too) is not kept waiting for seconds: its requests are answered
MODEL_UNAVAILABLE at once, with the seconds until the next child should be ready in
the message and in the outcome's stats (`retry_after_s`), and so is every batch until
that child listens (`runtimes.worker_side.supervisor`, RestartPending). A request whose output had
begun to stream is answered STREAM_INTERRUPTED instead. Each is answered once: the
outcome replaces the attempt's.

Cancels (`cancel`, a revoke): the child is told on its control connection, beside the
batches, and a batch of its pipeline that has not reached the device when all of its
requests are cancelled skips its forward; they are answered CANCELLED. The batch on the
device finishes, and so does one with a request still wanted (best effort: a cancel
that comes after the batch's device work began changes nothing in it).

Streams: a batch with streamed requests sends their deltas as it goes (see
`runtimes.wire.frames`). A request whose output has begun to go out is never run
again after a failure (its caller would read the beginning twice): it is
answered STREAM_INTERRUPTED, and only the rest of the batch is bisected.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from runtimes.base import (
    Delta,
    LoadFailed,
    OnDeltas,
    Outcome,
    Request,
    failed,
)
from runtimes.model_files.footprint import UNKNOWN_BYTES, estimate_bytes
from runtimes.model_files.sources import resolve_source
from runtimes.wire.frames import (
    BATCH_REPLY_DECODER,
    CONTROL_REPLY_DECODER,
    BatchReply,
    Cancel,
    ControlReply,
    Deltas,
    Failed,
    Load,
    Loaded,
    Outcomes,
    Ping,
    Probe,
    Rejected,
    Run,
    RunOutcome,
    RunRequest,
    StreamDelta,
    Unload,
)
from runtimes.wire.protocol import (
    PROBE_ID,
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    encode_frame,
    recv_frame,
)
from runtimes.worker_side.bisection import Failure, bisect
from runtimes.worker_side.pool import keys_of, lora_key
from runtimes.worker_side.supervisor import RestartPending, RuntimeChild, Supervisor
from runtimes.worker_side.turns import Stale
from tasks.catalog import load_catalog
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)

_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)
# How long a cancel waits for another frame being written on the control connection (a
# load's few bytes) before it gives up telling the child: the caller is the worker's loop.
CANCEL_WRITE_WAIT_S = 0.05


@dataclass(slots=True)
class _Call:
    """One `run_batch` call's state through its bisection."""

    on_deltas: OnDeltas | None
    streamed: set[str] = field(default_factory=set)  # its requests whose deltas went out
    # Failed once: its frames from now on go alone. With another batch in flight a crash
    # fails both, and only a failure with nothing else in flight blames a request.
    alone: bool = False


class ProcessRuntime:
    """`runtimes.base.Runtime` backed by a child process; see the module doc for the policy.

    `run_batch` is called from up to `pipeline_depth` threads at a time (their batches
    share the connection and are answered in the order sent; each bisects its own on a
    failure), `load` and `unload` from one other thread (they run beside batches);
    `close` may come from any thread. Counters for metrics: `restarts` (replacement
    children, spawned or promoted, failed starts included), `poison_isolated`,
    `spare_promotions`, `start_failures`; `pid` is the current child's, `spare_pid` the
    spare's.

    `models` load at start. A child that replaces a dead one loads every model resident
    in its predecessor (`resident`) before it is ready, so that what the worker believes
    loaded stays loaded. With `spare`, a spare child is kept imported ahead to be that
    replacement (see `runtimes.worker_side.supervisor`).
    """

    def __init__(
        self,
        catalog_dir: Path | str,
        models: list[str],
        device: str = "cpu",
        threads: int = 0,
        chunk_tokens: int = 16_384,
        start_timeout: float = 300.0,
        env: Mapping[str, str] | None = None,
        batch_timeout: float | None = None,
        spare: bool = False,
        precision: str | None = None,
        pipeline_depth: int = 2,
        engine: str = "pytorch",
        answer_while_restarting: bool = False,
    ) -> None:
        self.resident: dict[str, int] = dict.fromkeys(models, 0)  # model -> measured bytes
        self.start_timeout = start_timeout
        # Batches `run_batch` may be running at once (from as many threads): the child
        # computes one while it prepares the next (`runtimes.child_side.pipeline`).
        self.pipeline_depth = pipeline_depth
        self.parallel = 1  # one child computes one batch at a time (`ReplicaSet` has more)
        self._catalog_dir = catalog_dir
        # A model that hangs (a deadlocked kernel, a stuck device) is killed
        # after this long and treated like a crash: restart, then bisect.
        self.batch_timeout = batch_timeout
        self.poison_isolated = 0
        # Batches are answered MODEL_UNAVAILABLE rather than wait for a failed restart's
        # next child to import (see the module doc); False: they wait, as loads do.
        self._wait_for_restart = not answer_while_restarting
        argv = [
            sys.executable, "-m", "runtimes.child_side.server",
            "--catalog-dir", str(catalog_dir), "--device", device,
            "--threads", str(threads), "--chunk-tokens", str(chunk_tokens),
            "--parent-pid", str(os.getpid()),
            *(["--precision", precision] if precision else []),
            "--engine", engine,
        ]
        # OpenMP threads that spin between ops steal the cores the worker,
        # gateway and broker need on a CPU host: measured on 2 cores, passive
        # waiting cut the runtime's CPU per sentence from ~10 ms to ~6.5 ms.
        # But a thread that sleeps at once pays a futex wake-up at each of the forward's
        # hundreds of parallel regions: MiniLM's one-text forward took 12.5 ms instead of
        # 6.0. A short spin first (libgomp's GOMP_SPINCOUNT, which overrides the policy;
        # its default is 300k) keeps the threads awake between the ops of one forward:
        # at 10k a lone request took 10 ms instead of 15. Spinning longer takes the cores
        # the rest of the stack needs under load: at 32 clients p99 was 136-153 ms with
        # no spin, 206-211 at 10k, 539-549 at 100k (BENCHMARKS.md, "A lone request").
        # GOMP_SPINCOUNT=0 in the worker's environment puts the tail first.
        child_env = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000", **os.environ,
                     "TOKENIZERS_PARALLELISM": "true", **(env or {}), "PYTHONUNBUFFERED": "1"}
        # The child imports the very code the worker runs, installed or not.
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_SOURCE_ROOT, child_env.get("PYTHONPATH")) if p
        )
        self._lock = threading.Lock()  # guards the children, resident and the sets below
        self._controlling = threading.Lock()  # one load or unload at a time
        # One frame's bytes at a time on the control connection: a cancel goes beside a
        # load that waits for its reply (`_tell_cancelled`).
        self._control_writing = threading.Lock()
        self._cancelled: set[str] = set()  # requests of running batches whose callers left
        self._running: set[str] = set()  # the running batches' request ids
        self._children = Supervisor(argv, child_env, self.resident, self._lock,
                                    start_timeout, spare)
        try:
            self._children.ready_child()
            # Only now: on a small host its imports would slow the first start.
            self._children.start_spare()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        child = self._children.child
        return child.pid if child is not None else None

    @property
    def spare_pid(self) -> int | None:
        """The spare's process (None: no spare now, or spares are off)."""
        spare = self._children.spare
        return spare.pid if spare is not None else None

    def spare_ready(self) -> bool:
        """A spare is alive and done importing: a death now costs only the model loads."""
        spare = self._children.spare
        return spare is not None and spare.proc.poll() is None and spare.listening()

    @property
    def device_bytes(self) -> int | None:
        """The device's memory, from the child (None: not known)."""
        return self._children.device_bytes

    @property
    def restarts(self) -> int:
        return self._children.restarts

    @property
    def spare_promotions(self) -> int:
        return self._children.spare_promotions

    @property
    def start_failures(self) -> int:
        return self._children.start_failures

    @property
    def _child(self) -> RuntimeChild | None:
        return self._children.child

    def __enter__(self) -> ProcessRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Runtime ----------------------------------------------------------------------

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None) -> list[Outcome]:
        if not requests:
            return []
        call = _Call(on_deltas if any(r.stream for r in requests) else None)
        ids = {r.id for r in requests}
        with self._lock:
            self._running |= ids
        try:
            result = self._attempt(call, model_id, requests)
            if not isinstance(result, Failure):
                return result
            return bisect(model_id, requests, result,
                          lambda part: self._attempt(call, model_id, part),
                          lambda: self.probe(model_id), self._isolated)
        except RestartPending as exc:  # the probe's wait (a part's is answered in _attempt)
            return self._unavailable(call, requests, exc)
        finally:
            with self._lock:
                self._running -= ids
                self._cancelled -= ids

    def cancel(self, request_ids: list[str]) -> None:
        """These requests' callers left (any thread; ids of no running request are
        ignored). A streamed batch drops their rows at its next step; the child is told
        too, on its control connection, so that a batch of its pipeline whose requests are
        all cancelled before it reaches the device skips it (they are answered CANCELLED;
        a batch on the device finishes). Best effort, and never waits long: see
        `_tell_cancelled`."""
        with self._lock:
            new = [i for i in request_ids if i in self._running and i not in self._cancelled]
            self._cancelled.update(new)
            child = self._children.child
        if new and child is not None:
            self._tell_cancelled(child, new)

    def _tell_cancelled(self, child: RuntimeChild, ids: list[str]) -> None:
        """Send the child a `Cancel` on its control connection (unanswered: a load waiting
        for its reply there is not disturbed). Skipped when the child is not serving yet
        (a promoted spare's loads use the connection), when another frame is being
        written for more than a moment, or when the child is gone (its batches fail
        anyway)."""
        if child.control is None or child.sock is None or child.spare:
            return
        try:
            payload = encode_frame(Cancel(ids))
        except FrameTooLarge:
            return
        if not self._control_writing.acquire(timeout=CANCEL_WRITE_WAIT_S):
            log.warning("the control connection was busy: %d cancelled requests were not "
                        "told to the model runtime", len(ids))
            return
        try:
            child.control.sendall(payload)
        except OSError as exc:
            log.info("could not tell the model runtime of %d cancelled requests: %s",
                     len(ids), exc)
        finally:
            self._control_writing.release()

    def continuous(self, model_id: str) -> bool:
        return False

    def estimate_bytes(self, model: str, lora: str | None = None) -> int:
        """What `model` (or its LoRA adapter `lora`) should take once loaded, from its
        weight files (read here, in the worker: nothing is loaded or downloaded)."""
        entry = load_catalog(self._catalog_dir).get(model)
        source = None if entry is None else entry.source if lora is None \
            else entry.loras.get(lora)
        try:
            return estimate_bytes(resolve_source(source, local_only=True)) if source \
                else UNKNOWN_BYTES
        except Exception:  # not downloaded yet, or unreadable: the load will say
            return UNKNOWN_BYTES

    def load(self, model: str, lora: str | None = None) -> int:
        """Load `model` (or its LoRA adapter `lora`) in the child beside the batches that
        run meanwhile: the device bytes it takes. LoadFailed if it cannot (the child
        survives a bad model; if the load kills it, the next child starts without it)."""
        key = model if lora is None else lora_key(model, lora)
        reply = self._control(Load(model, lora), f"loading {key}")
        if not isinstance(reply, Loaded):
            raise LoadFailed(reply.reason if isinstance(reply, Failed | Rejected) else
                             f"unexpected reply from the model runtime: {reply!r:.200}")
        with self._lock:
            self.resident[key] = reply.bytes
        return reply.bytes

    def unload(self, model: str, lora: str | None = None) -> None:
        """Free a model and its LoRA adapters, or only its adapter `lora`."""
        with self._lock:
            if lora is not None:
                self.resident.pop(lora_key(model, lora), None)
            else:
                for key in keys_of(model, self.resident):
                    del self.resident[key]
        self._control(Unload(model, lora),
                      f"unloading {model if lora is None else lora_key(model, lora)}")

    def _control(self, frame: Load | Unload | Ping, doing: str) -> ControlReply:
        with self._controlling:
            child = self._children.ready_child()
            assert child.control is not None
            try:
                with self._control_writing:
                    child.control.sendall(encode_frame(frame))
                reply = recv_frame(child.control, CONTROL_REPLY_DECODER)
            except MalformedFrame as exc:
                raise LoadFailed(f"unexpected reply from the model runtime: {exc}") from exc
            except (OSError, EOFError, ProtocolError) as exc:
                how = self._children.replace_dead(child, f"control connection lost: {exc}")
                raise LoadFailed(f"the model runtime died while {doing} ({how})") from exc
        return reply

    def close(self) -> None:
        """Stop the child and the spare (mid-batch too: the batch raises RuntimeClosed)."""
        self._children.close()

    # --- bisection (`runtimes.worker_side.bisection`) ---------------------------------------------

    def _attempt(self, call: _Call, model: str, requests: list[Request]
                 ) -> list[Outcome] | Failure:
        """Run `requests` once: their outcomes, or how it failed (with the requests of
        theirs whose output went out). After a failure the call's frames go alone; while
        a failed restart's next child imports, they are answered MODEL_UNAVAILABLE."""
        try:
            result = self._call(call, model, requests)
        except RestartPending as exc:
            return self._unavailable(call, requests, exc)
        if isinstance(result, Failure):
            call.alone = True
            streamed = call.streamed.intersection(r.id for r in requests)
            if streamed:
                result = dataclasses.replace(result, streamed=frozenset(streamed))
        return result

    @staticmethod
    def _unavailable(call: _Call, requests: list[Request], pending: RestartPending
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

    def _isolated(self, request: Request, why: str) -> None:
        self.poison_isolated += 1

    def probe(self, model: str) -> str | None:
        """Run the model's probe: None when it was answered, else what went wrong."""
        result = self._exchange(_Call(None), Probe(model), [PROBE_ID])
        if isinstance(result, Failure):
            return f"{result.kind}: {result.detail}"
        (outcome,) = result
        if not outcome.ok:
            # A refused probe proves nothing either way (and is a bug in the adapter's probe).
            return f"the probe was refused: {outcome.error_code}: {outcome.error_message}"
        return None

    # --- one round trip ---------------------------------------------------------------

    def _call(self, call: _Call, model: str, requests: list[Request]
              ) -> list[Outcome] | Failure:
        frame = Run(model, [RunRequest(r.id, r.op, r.kwargs, r.stream) for r in requests],
                    call.on_deltas is not None)
        return self._exchange(call, frame, [r.id for r in requests])

    def _exchange(self, call: _Call, frame: Run | Probe, ids: list[str]
                  ) -> list[Outcome] | Failure:
        """Send a run or probe frame; the outcomes (for `ids`, in order) or how it failed.

        Batches from several threads share the connection (the child answers them in
        the order they came, `runtimes.child_side.pipeline`): each waits for its turn to read. A
        frame that talks back (a stream's deltas) or must run alone (a probe) waits
        until nothing else is in flight and keeps the connection for its exchange."""
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

    def _send(self, call: _Call, child: RuntimeChild, payload: bytearray, alone: bool,
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

    def _converse(self, call: _Call, child: RuntimeChild, ids: list[str]) -> BatchReply:
        """The replies to a frame sent alone, up to its last: a stream's deltas, each
        answered with the cancels since."""
        assert child.sock is not None
        reply = recv_frame(child.sock, BATCH_REPLY_DECODER)
        while isinstance(reply, Deltas):
            self._forward(call, reply.deltas)
            with self._lock:
                cancel = [i for i in ids if i in self._cancelled]
            child.sock.sendall(encode_frame(Cancel(cancel)))
            reply = recv_frame(child.sock, BATCH_REPLY_DECODER)
        return reply

    def _forward(self, call: _Call, raw: list[StreamDelta]) -> None:
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
