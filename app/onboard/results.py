"""What an onboarding run found, as plain data: the report (`app.onboard.report`) draws
it and the resume file (`app.onboard.catalog_run`) stores it as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["tuned", "verified", "refused", "failed", "skipped"]


@dataclass
class CurvePoint:
    """One load level of a closed-loop sweep against the live stack."""

    load: float  # concurrent clients
    throughput: float  # requests per second
    p50_ms: float | None
    p99_ms: float | None


@dataclass
class Candidate:
    """One way to serve the model on this device: a runtime at a precision."""

    runtime: str  # an engine of tasks.engines (its `candidates`)
    precision: str  # fp32 | bf16 | fp16 | int8
    parity: dict[str, float] = field(default_factory=dict)  # figure name -> value
    parity_ok: bool = False
    tolerance: str = ""  # the stated tolerance the figures were held to
    knee_throughput: float | None = None  # requests per second at the knee
    knee_p99_ms: float | None = None
    knee_load: float | None = None
    curve: list[CurvePoint] = field(default_factory=list)
    chosen: bool = False
    note: str = ""  # why it was not measured or not chosen

    @property
    def label(self) -> str:
        return f"{self.runtime} {self.precision}"


@dataclass
class ModelReport:
    """One model's onboarding: detection, parity per candidate, the chosen profile."""

    model: str
    adapter: str
    status: Status
    reason: str = ""  # one line: what was refused or failed, or why skipped
    weights_hash: str = ""
    device: str = ""
    seconds: float = 0.0
    candidates: list[Candidate] = field(default_factory=list)
    choices: list[str] = field(default_factory=list)  # e.g. "pooling=mean (1_Pooling/config.json)"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelReport:
        candidates = [Candidate(**{**c, "curve": [CurvePoint(**p) for p in c["curve"]]})
                      for c in data.get("candidates", [])]
        return cls(**{**data, "candidates": candidates})

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.chosen), None)
