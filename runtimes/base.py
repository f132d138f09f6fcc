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


class Runtime(Protocol):
    """What the worker runs batches on: one batch of one model at a time.

    Implementations: in a child process that may crash without taking the
    worker down (`runtimes.worker_side.process.ProcessRuntime`, several of them on one device in
    `runtimes.worker_side.replicas.ReplicaSet`), SGLang servers (`runtimes.sglang.SGLangRuntime`),
    several engines by model (`runtimes.worker_side.router.RuntimeRouter`), and simulated devices
    (`runtimes.doubles.sim.SimRuntime`). Every member here is one the worker reads or calls.
    The in-process `runtimes.child_side.host.ModelHost` computes the same batches but is no
    Runtime: it has nothing to restart.
    """

    # Counters the worker's metrics read: child restarts so far, and requests
    # blamed as POISON_INPUT so far (0 where nothing can crash).
    restarts: int
    poison_isolated: int

    @property
    def spare_promotions(self) -> int:
        """Restarts that promoted a spare child (0 where there is none): a worker gauge."""
        ...

    @property
    def start_failures(self) -> int:
        """Replacement children that failed to start (0 where nothing restarts): a gauge."""
        ...

    @property
    def pipeline_depth(self) -> int:
        """Batches `run_batch` may run at once: the worker's runtime threads (1: one)."""
        ...

    @property
    def parallel(self) -> int:
        """Batches run side by side (replicas): the worker's scheduler starts that many."""
        ...

    @property
    def pid(self) -> int | None:
        """The process the models run in now; None where there is no child process."""
        ...

    # The models loaded now (and LoRA adapters, as `runtimes.worker_side.pool.lora_key`), with the
    # device bytes each takes; and the device's memory
    # (None: unknown, the worker's settings decide the budget).
    resident: dict[str, int]
    device_bytes: int | None

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None) -> list[Outcome]:
        """Run one batch; the deltas of its `stream` requests go to `on_deltas` as they are
        made (a runtime that cannot stream sends none: the final result holds all)."""
        ...

    def cancel(self, request_ids: list[str]) -> None:
        """Stop generating for these requests (their callers left), from any thread: a
        running one ends at its next token with what it has (finish_reason "cancelled")."""
        ...

    def continuous(self, model_id: str) -> bool:
        """Whether the model's runtime batches continuously (`ContinuousRuntime.submit`
        one request at a time) rather than running the worker's batches."""
        ...

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

    def close(self) -> None: ...


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
    each request over at once while `load` says it has room, instead of batching."""

    def submit(self, model_id: str, request: Request,
               on_deltas: OnDeltas | None = None) -> Future[Outcome]:
        """Start one request; its outcome when it ends (never raises: a failure is an
        outcome). Thread-safe."""
        ...

    def load_of(self, model_id: str) -> Load: ...


# The file an emulated device's queue lives in, shared by the processes of one device
# (`runtimes.worker_side.replicas` sets it, `runtimes.doubles.emulated` reads it).
EMULATED_QUEUE_ENV = "SHOAL_EMULATE_DEVICE_QUEUE"
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
