"""A runtime whose models live in a child process, so that the worker survives them.

The child (`python -m runtimes.child_side.server`) is spawned, never forked, and reached
over a private Unix socket with msgpack frames (`runtimes.wire.frames`). A segfault, an
OOM kill, a CUDA error or an exception in the model ends at most that child; the
worker restarts it (`runtimes.worker_side.supervisor`: restarts, the spare, failed starts) and
finds which request is to blame (`runtimes.worker_side.bisection`: the restart and bisect policy,
the probe). A child that dies between batches is replaced when it dies, by the runtime's
watcher (`runtimes.worker_side.watcher`), not by the next batch sent to it.

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

The two connections to the child have their own modules: a batch's attempts (frames,
turns, streams, failures) `runtimes.worker_side.batch_channel`; loads, unloads and
cancels `runtimes.worker_side.control_channel`. This one owns the child's settings,
what is resident, which requests run and which were cancelled, and each batch's
bisection.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from batching.pool import keys_of, lora_key
from runtimes.base import (
    BatchesOnly,
    Capabilities,
    LoadFailed,
    OnDeltas,
    Outcome,
    Request,
    SentAhead,
)
from runtimes.model_files.footprint import UNKNOWN_BYTES, estimate_bytes
from runtimes.wire.frames import Failed, Load, Loaded, Rejected, Unload
from runtimes.worker_side.batch_channel import Ahead, BatchCall, BatchChannel, unavailable
from runtimes.worker_side.bisection import Failure, bisect
from runtimes.worker_side.control_channel import ControlChannel
from runtimes.worker_side.runtime_child import RuntimeChild
from runtimes.worker_side.supervisor import RestartPending, Supervisor
from runtimes.worker_side.watcher import ChildWatcher
from tasks import engines
from tasks.catalog import load_catalog
from tasks.sources import resolve_source

_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


class ProcessRuntime(BatchesOnly):
    """`runtimes.base.Runtime` backed by a child process; see the module doc for the policy.

    `run_batch` is called from up to `pipeline_depth` threads at a time (their batches
    share the connection and are answered in the order sent; each bisects its own on a
    failure), `load` and `unload` from one other thread (they run beside batches);
    `close` may come from any thread. Counters for metrics: `restarts` (replacement
    children, spawned or promoted, failed starts included), `poison_isolated`,
    `spare_promotions`, `start_failures`; `pid` is the current child's, `spare_pid` the
    spare's.

    `host_bytes` is the child's host-memory tier (`runtimes.child_side.host_tier`; 0: off):
    a model it unloads is kept in host memory while it fits, and loads again from there.

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
        engine: str = engines.DEFAULT,
        answer_while_restarting: bool = False,
        host_bytes: int = 0,
    ) -> None:
        self.resident: dict[str, int] = dict.fromkeys(models, 0)  # model -> measured bytes
        self.start_timeout = start_timeout
        # Batches `run_batch` may be running at once (from as many threads): the child
        # computes one while it prepares the next (`runtimes.child_side.pipeline`); one
        # child computes one batch at a time (`ReplicaSet` has more side by side).
        self.capabilities = Capabilities(pipeline_depth=pipeline_depth, send_ahead=True)
        self._catalog_dir = catalog_dir
        self.poison_isolated = 0
        argv = [
            sys.executable, "-m", "runtimes.child_side.server",
            "--catalog-dir", str(catalog_dir), "--device", device,
            "--threads", str(threads), "--chunk-tokens", str(chunk_tokens),
            "--parent-pid", str(os.getpid()),
            *(["--precision", precision] if precision else []),
            "--engine", engine, "--host-bytes", str(host_bytes),
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
        self._cancelled: set[str] = set()  # requests of running batches whose callers left
        self._running: set[str] = set()  # the running batches' request ids
        self._children = Supervisor(argv, child_env, self.resident, self._lock,
                                    start_timeout, spare)
        # A model that hangs (a deadlocked kernel, a stuck device) is killed after
        # `batch_timeout` and treated like a crash: restart, then bisect. Batches are
        # answered MODEL_UNAVAILABLE rather than wait for a failed restart's next child to
        # import (see the module doc); without `answer_while_restarting` they wait, as
        # loads do.
        self._batches = BatchChannel(self._children, batch_timeout,
                                     not answer_while_restarting, self._cancelled_among)
        self._controls = ControlChannel(self._children)
        self._watcher: ChildWatcher | None = None
        self._on_availability: Callable[[], None] = lambda: None
        try:
            self._children.ready_child()
            # Only now: on a small host its imports would slow the first start.
            self._children.start_spare()
            # A child that dies between batches is replaced when it dies
            # (`runtimes.worker_side.watcher`), not when the next batch finds it dead.
            self._watcher = ChildWatcher(self._children)
            self._children.changed = self._changed
        except BaseException:
            self.close()
            raise

    def _changed(self) -> None:
        if self._watcher is not None:
            self._watcher.wake()
        self._on_availability()

    def watch_availability(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from any thread, holding no lock: it must not block) whenever
        the child changes or batches start or stop being refused (`ready_in`)."""
        self._on_availability = callback

    def ready_in(self, model_id: str) -> float | None:
        """While batches are refused MODEL_UNAVAILABLE (a failed restart's replacement
        imports): the seconds until it should serve, from the measured starts; else None
        (it serves, or a batch would wait for it)."""
        return self._children.ready_in()

    @property
    def up(self) -> bool:
        """A child is connected and serving (not dead, not a spare being promoted)."""
        child = self._children.child
        return child is not None and child.sock is not None and not child.spare \
            and child.proc.poll() is None

    @property
    def deaths_noticed(self) -> int:
        """Children found dead between batches by the watcher (a gauge's source)."""
        return self._watcher.deaths_noticed if self._watcher is not None else 0

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
    def batch_timeout(self) -> float | None:
        """Seconds a batch may go without a reply before its child counts as hung."""
        return self._batches.batch_timeout

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

    def send_ahead(self, model_id: str, requests: list[Request]) -> Ahead | None:
        """Send a batch's frame now, from the worker's loop, which must not wait: the child
        starts on it while the batch's thread wakes up, and that thread's `run_batch` with
        this `ahead` reads the reply (and settles a failure, bisection included, as for a
        frame it sent). None, with nothing sent, where it would wait or the batch streams
        (`BatchChannel.send_ahead`); the batch then runs as usual. An `Ahead` whose batch
        will not run must be discarded (`Ahead.discard`)."""
        if not requests or self._children.closed:
            return None
        return self._batches.send_ahead(model_id, requests)

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None, ahead: SentAhead | None = None
                  ) -> list[Outcome]:
        """`Runtime.run_batch`; `ahead`: its frame was sent by this runtime's `send_ahead`."""
        if not requests:
            return []
        assert ahead is None or isinstance(ahead, Ahead), ahead
        call = BatchCall(on_deltas if any(r.stream for r in requests) else None)
        ids = {r.id for r in requests}
        with self._lock:
            self._running |= ids
        try:
            result = self._batches.attempt(call, model_id, requests, ahead)
            if not isinstance(result, Failure):
                return result
            return bisect(model_id, requests, result,
                          lambda part: self._batches.attempt(call, model_id, part),
                          lambda: self.probe(model_id), self._isolated)
        except RestartPending as exc:  # the probe's wait (a part's is answered in attempt)
            return unavailable(call, requests, exc)
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
        `ControlChannel.tell_cancelled`."""
        with self._lock:
            new = [i for i in request_ids if i in self._running and i not in self._cancelled]
            self._cancelled.update(new)
            child = self._children.child
        if new and child is not None:
            self._controls.tell_cancelled(child, new)

    def _cancelled_among(self, ids: list[str]) -> list[str]:
        with self._lock:
            return [i for i in ids if i in self._cancelled]

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
        reply = self._controls.call(Load(model, lora), f"loading {key}")
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
        self._controls.call(Unload(model, lora),
                            f"unloading {model if lora is None else lora_key(model, lora)}")

    def close(self) -> None:
        """Stop the child and the spare (mid-batch too: the batch raises RuntimeClosed)."""
        self._children.close()
        if self._watcher is not None:
            self._watcher.close()

    # --- bisection (`runtimes.worker_side.bisection`) --------------------------------

    def _isolated(self, request: Request, why: str) -> None:
        self.poison_isolated += 1

    def probe(self, model: str) -> str | None:
        """Run the model's probe: None when it was answered, else what went wrong."""
        return self._batches.probe(model)
