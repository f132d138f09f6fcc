"""The runtime process's spans, when tracing is on (`tasks.tracing.ENABLED`, from the
environment the worker passes on; nothing here is imported otherwise).

A batch whose requests carry the worker's batch context (`runtimes.base.Request.trace`)
gets `runtime <model>`, a child of the worker's `batch <model>` span, from the batch's
frame being read to its reply sent, and under it one span per stage of the pipeline
(`runtimes.child_side.pipeline`): `prepare` (decode, check, tokenize, pad), `device` (the
forward queued and its outputs' copy started; on a GPU the device may still run after it)
and `results` (the outputs waited for, turned into results, the reply sent). The stages
overlap other batches' (the pipeline holds three), so a stage's start is when this batch
got its thread, not when the previous stage ended: the gaps are its waits for a thread.

Each stage's clock is read on its own thread as the batch passes (`Stamps`); the spans are
made once the reply is out, off the batch's path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tasks import tracing

STAGES = ("prepare", "device", "results")


@dataclass(slots=True)
class Stamps:
    """A traced batch's clock readings (epoch ns): the start and end of each stage."""

    trace: str
    times: list[int] = field(default_factory=list)

    def now(self) -> None:
        self.times.append(time.time_ns())


def record(model: str, requests: int, stamps: Stamps, failure: BaseException | None) -> None:
    """The batch's spans, from its stamps (six: each stage's start and end)."""
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    times = stamps.times
    if len(times) != 2 * len(STAGES):
        return
    parent = tracing.context_of(stamps.trace)
    span = tracing.tracer().start_span(
        f"runtime {model}", context=parent, start_time=times[0],
        attributes={"shoal.model": model, "shoal.batch.requests": requests})
    if failure is not None:
        span.set_status(Status(StatusCode.ERROR, repr(failure)[:200]))
    inside = trace.set_span_in_context(span)
    for i, stage in enumerate(STAGES):
        tracing.record_span(stage, inside, times[2 * i], times[2 * i + 1])
    span.end(end_time=times[-1])
