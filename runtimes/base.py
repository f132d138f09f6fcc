"""What a runtime takes and gives back: plain data that crosses any boundary."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from batching.feeder import Load

if TYPE_CHECKING:
    from tasks.catalog import ModelEntry
    from tasks.settings import Settings


@dataclass(slots=True)
class Request:
    """One request of a batch: its id, operation and decoded task kwargs.

    `stream`: the caller follows its tokens as they are made (deltas go to the batch's
    `on_deltas`). `deadline_ms`: epoch ms after which nobody wants the result (a runtime
    that can abort a running request does so; None: no deadline)."""

    id: str
    op: str
    kwargs: dict[str, Any]
    stream: bool = False
    deadline_ms: float | None = None
    # With tracing on: the W3C traceparent of the worker's span of the batch this request
    # runs in (`app.worker.lifecycle.traces`), which the runtime's spans continue.
    trace: str | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one item of a streamed generate request: `text` appended to its
    completion, which now holds `tokens` tokens."""

    id: str  # the request's
    index: int  # the item's place in the request
    text: str
    tokens: int


# Called with the deltas of one decode step (or one chunk a server streamed), from the
# runtime's thread; it must not block.
OnDeltas = Callable[[list[Delta]], None]


@dataclass(slots=True)
class Outcome:
    """The result of one request: `result` when ok, else `error_code` + `error_message`."""

    id: str
    result: dict[str, Any] | None = None
    error_code: str | None = None
    error_message: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error_code is None


# --- errors a runtime raises (the worker catches them by these types) -----------------------


class RuntimeStartError(RuntimeError):
    """The runtime process did not become ready (its output tail is in the message)."""


class RuntimeClosed(RuntimeError):
    """The runtime was closed; it runs nothing more."""


class RuntimeUnhealthy(RuntimeError):
    """The runtime fails whatever the input, so no request of the batch is to blame."""


class LoadFailed(RuntimeError):
    """A model could not be loaded (the reason is the message); the runtime still serves
    the models it had."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine can do, declared as data and read once by the worker's loop."""

    pipeline_depth: int = 1  # batches run_batch may run at once (the worker's runtime threads)
    parallel: int = 1  # batches run side by side (replicas): the scheduler starts that many
    send_ahead: bool = False  # send_ahead() can ship a lone batch's frame from the loop


class SentAhead(Protocol):
    """A runtime's handle of a frame sent ahead (opaque to the worker): `run_batch` with it
    reads the reply; a batch that will not run discards it."""

    def discard(self) -> None: ...


class NotContinuous(RuntimeError):
    """`submit` on a model its runtime does not batch continuously (`continuous` is False)."""


class BatchesOnly:
    """The `Compute` members of a runtime that only runs the worker's batches: no model is
    continuous, and nothing is sent ahead unless the runtime says otherwise."""

    def continuous(self, model_id: str) -> bool:
        return False

    def send_ahead(self, model_id: str, requests: list[Request]) -> SentAhead | None:
        return None

    def submit(self, model_id: str, request: Request,
               on_deltas: OnDeltas | None = None) -> Future[Outcome]:
        raise NotContinuous(f"{model_id} runs in the worker's batches, not continuously")

    def load_of(self, model_id: str) -> Load:
        raise NotContinuous(f"{model_id} runs in the worker's batches, not continuously")


class Compute(Protocol):
    """Running batches: what an engine can do, and the calls that use it."""

    @property
    def capabilities(self) -> Capabilities:
        """Read once by the worker when it starts (constant for the runtime's life)."""
        ...

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None, ahead: SentAhead | None = None
                  ) -> list[Outcome]:
        """Run one batch; the deltas of its `stream` requests go to `on_deltas` as they are
        made (a runtime that cannot stream sends none: the final result holds all).
        `ahead`: its frame went out already (`send_ahead`, same model and requests)."""
        ...

    def send_ahead(self, model_id: str, requests: list[Request]) -> SentAhead | None:
        """Ship a batch's first frame now, from the worker's loop, which must not wait;
        None (nothing sent) where it would wait or the runtime cannot
        (`capabilities.send_ahead` False: always None). A handle whose batch will not run
        must be discarded."""
        ...

    def continuous(self, model_id: str) -> bool:
        """Whether the model's runtime batches continuously (`submit` one request at a
        time) rather than running the worker's batches."""
        ...

    def submit(self, model_id: str, request: Request,
               on_deltas: OnDeltas | None = None) -> Future[Outcome]:
        """Start one request of a continuous model; its outcome when it ends (never raises:
        a failure is an outcome). Thread-safe. `NotContinuous` for a batched model."""
        ...

    def load_of(self, model_id: str) -> Load:
        """What a continuous model holds and has room for (the worker's feeder reads it).
        `NotContinuous` for a batched model."""
        ...

    def cancel(self, request_ids: list[str]) -> None:
        """Stop generating for these requests (their callers left), from any thread: a
        running one ends at its next token with what it has (finish_reason "cancelled")."""
        ...

    def close(self) -> None: ...


class ModelStore(Protocol):
    """The models on the device: what they take, loading and freeing them."""

    # The models loaded now (and LoRA adapters, as `batching.pool.lora_key`), with the
    # device bytes each takes; and the device's memory
    # (None: unknown, the worker's settings decide the budget).
    @property
    def resident(self) -> dict[str, int]: ...

    @property
    def device_bytes(self) -> int | None: ...

    def estimate_bytes(self, model_id: str, lora: str | None = None) -> int:
        """What the model (or its LoRA adapter `lora`) should take once loaded (made
        before loading it)."""
        ...

    def load(self, model_id: str, lora: str | None = None) -> int:
        """Load a model (or a LoRA adapter of a loaded one) beside running batches (from
        another thread): the device bytes it takes. Raises `LoadFailed`
        with the reason."""
        ...

    def unload(self, model_id: str, lora: str | None = None) -> None:
        """Free a model with its LoRA adapters, or one adapter (never one a batch uses)."""
        ...


class RuntimeStatistics(Protocol):
    """What the worker's metrics and pool states read of the runtime's supervision."""

    # Child restarts so far, and requests blamed as POISON_INPUT so far (0 where nothing
    # can crash).
    @property
    def restarts(self) -> int: ...

    @property
    def poison_isolated(self) -> int: ...

    @property
    def spare_promotions(self) -> int:
        """Restarts that promoted a spare child (0 where there is none): a worker gauge."""
        ...

    @property
    def start_failures(self) -> int:
        """Replacement children that failed to start (0 where nothing restarts): a gauge."""
        ...

    @property
    def pid(self) -> int | None:
        """The process the models run in now; None where there is no child process."""
        ...

    def ready_in(self, model_id: str) -> float | None:
        """While the model's batches are refused MODEL_UNAVAILABLE (a failed restart's
        replacement imports): the seconds until it should serve; else None."""
        ...

    def watch_availability(self, callback: Callable[[], None]) -> None:
        """Call `callback` (any thread, must not block) whenever `ready_in` may have
        changed (a child changed, refusals started or stopped); nothing where it cannot."""
        ...


class Runtime(Compute, ModelStore, RuntimeStatistics, Protocol):
    """What the worker runs batches on: compute, the model store and statistics
    (docs/runtimes.md, "The runtime contract").

    Implementations: in a child process that may crash without taking the
    worker down (`runtimes.worker_side.process.ProcessRuntime`, several of them on one device
    in `runtimes.worker_side.replicas.ReplicaSet`), SGLang servers
    (`runtimes.sglang.SGLangRuntime`), several engines by model
    (`runtimes.worker_side.router.RuntimeRouter`), and simulated devices
    (`runtimes.doubles.sim.SimRuntime`). Every member here is one the worker reads or calls.
    The in-process `runtimes.child_side.host.ModelHost` computes the same batches but is no
    Runtime: it has nothing to restart.
    """


class StartRuntime(Protocol):
    """How the worker starts an engine that is no runtime process of shoal's: its own
    servers (SGLang) or a double (the simulated device). The registry (`tasks.engines`)
    names it as an entry's `start`."""

    def __call__(self, entries: list[ModelEntry], pinned: list[str], settings: Settings
                 ) -> Runtime:
        """The engine's runtime for `entries` (the models of the worker it serves), the
        `pinned` ones loaded before it returns."""
        ...


class ContinuousRuntime(Runtime, Protocol):
    """A runtime that forms its own batches as requests arrive (SGLang): the worker hands
    each request over at once (`submit`) while `load_of` says it has room, instead of
    batching."""


# Names the device a runtime process computes on, the same in every process that shares
# it (the replicas of one device: `runtimes.worker_side.replicas` sets it); a stand-in
# device that keeps its own queue of passes shares it among them (`runtimes.doubles`).
DEVICE_GROUP_ENV = "SHOAL_DEVICE_GROUP"
CANCELLED = "cancelled"  # the finish_reason of a generation its caller abandoned


def failed(request_id: str, code: str, message: str) -> Outcome:
    return Outcome(request_id, error_code=str(code), error_message=message)


def prepare_each(model_id: str, operation: str, requests: list[Request],
                 prepare: Callable[[Request], Any]
                 ) -> tuple[dict[str, Outcome], list[tuple[Request, Any]]]:
    """Check every request of a batch before it runs: (failed outcomes by id, the
    runnable requests with what `prepare` made of them). A request for another
    operation, or one `prepare` refuses with a ShoalError, fails alone."""
    from tasks.errors import ErrorCode, ShoalError

    outcomes: dict[str, Outcome] = {}
    runnable: list[tuple[Request, Any]] = []
    for request in requests:
        try:
            if request.op != operation:
                raise ShoalError(ErrorCode.UNSUPPORTED_OPERATION,
                                 f"{model_id} serves '{operation}', not '{request.op}'")
            runnable.append((request, prepare(request)))
        except ShoalError as exc:
            outcomes[request.id] = failed(request.id, exc.code, exc.message)
    return outcomes, runnable
