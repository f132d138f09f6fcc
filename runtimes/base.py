"""What a runtime takes and gives back: plain data that crosses any boundary."""

from __future__ import annotations

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
    """Runs one batch of one model.

    Implementations: in-process (`runtimes.host.ModelHost`) and in a child
    process that may crash without taking the caller down
    (`runtimes.process.ProcessRuntime`).
    """

    def run_batch(self, model_id: str, requests: list[Request]) -> list[Outcome]: ...

    def close(self) -> None: ...
