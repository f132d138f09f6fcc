"""What a runtime takes and gives back: plain data that crosses any boundary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class Request:
    """One request of a batch: its id, operation and decoded task kwargs."""

    id: str
    op: str
    kwargs: dict[str, Any]


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


class Runtime(Protocol):
    """What the worker runs batches on: one batch of one model at a time.

    Implementations: in a child process that may crash without taking the
    worker down (`runtimes.process.ProcessRuntime`), and simulated devices
    (`runtimes.sim.SimRuntime`). The in-process `runtimes.host.ModelHost`
    computes the same batches but is no Runtime: it has nothing to restart.
    """

    # Counters the worker's metrics read: child restarts so far, and requests
    # blamed as POISON_INPUT so far (0 where nothing can crash).
    restarts: int
    poison_isolated: int

    @property
    def pid(self) -> int | None:
        """The process the models run in now; None where there is no child process."""
        ...

    # The models loaded now (and LoRA adapters, as `runtimes.pool.lora_key`), with the
    # device bytes each takes; and the device's memory
    # (None: unknown, the worker's settings decide the budget).
    resident: dict[str, int]
    device_bytes: int | None

    def run_batch(self, model_id: str, requests: list[Request]) -> list[Outcome]: ...

    def estimate_bytes(self, model_id: str, lora: str | None = None) -> int:
        """What the model (or its LoRA adapter `lora`) should take once loaded (made
        before loading it)."""
        ...

    def load(self, model_id: str, lora: str | None = None) -> int:
        """Load a model (or a LoRA adapter of a loaded one) beside running batches (from
        another thread): the device bytes it takes. Raises `runtimes.process.LoadFailed`
        with the reason."""
        ...

    def unload(self, model_id: str, lora: str | None = None) -> None:
        """Free a model with its LoRA adapters, or one adapter (never one a batch uses)."""
        ...

    def close(self) -> None: ...


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
