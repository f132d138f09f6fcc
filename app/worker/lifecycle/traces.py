"""A worker's spans, when tracing is on (`tasks.tracing.ENABLED`; the loop's hooks test that
flag and call nothing here otherwise, so nothing of OpenTelemetry is imported).

Per request, in the trace its message carries (`tasks.envelope`: a coalesced message's
members each their own; a request without one starts a trace of its own):

- `queued <model>`: from its publish (the sender's `shoal_sent_us` stamp) to its delivery
  here: the outbox's turn, the broker and RabbitMQ's queue (one clock: hosts' skew shows);
- `request <model>` (a consumer span): from its delivery to its answer, with the outcome
  (`shoal.outcome`: ok, or the error code; `returned` when handed back to the queue); its
  hold (delivery to the start of its batch) ends at its event `batch started`, with
  `shoal.hold_ms` (an event, not a span of its own: a span costs ~100 µs of CPU made and
  exported, measured, where a one-text request costs the stack ~800).

Per batch, `batch <model>`: from its start to its end, with its size, items and tokens,
LINKED to the `request` span of every request it runs; a batch of one request is also
that span's child, so a lone request is one trace from the caller to the runtime. Its
context travels to the runtime process (`runtimes.base.Request.trace`), whose stages are
its children (`runtimes.child_side.spans`).
"""

from __future__ import annotations

import time
from typing import Any

from app.worker.lifecycle.held import Held
from batching.former import batch_tokens
from batching.lanes import Batch
from runtimes.base import Outcome
from tasks import tracing

_open_batches: dict[int, Any] = {}  # id(batch) -> its span, from its start to its end


def _attributes(model: str, held: Held) -> dict[str, Any]:
    a = held.annotations
    out: dict[str, Any] = {"shoal.model": model, "shoal.op": a.op, "shoal.items": a.items,
                           "shoal.tokens": a.cost, "shoal.task_id": held.task_id,
                           "messaging.system": "rabbitmq"}
    if a.deadline_ms is not None:
        out["shoal.deadline_ms"] = a.deadline_ms
    if a.lora:
        out["shoal.lora"] = a.lora
    return out


def received(model: str, held: Held) -> None:
    """A request was delivered: its `queued` span, and its `request` span begins; nothing
    for a request whose trace its sender did not sample."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    a = held.annotations
    parent = tracing.context_of(a.traceparent, a.tracestate)
    sent = trace.get_current_span(parent).get_span_context()
    if sent.is_valid and not sent.trace_flags.sampled:
        return
    now_ns = int(held.delivery.received * 1e9)
    attributes = _attributes(model, held)
    if a.sent_ms:  # (the request's attributes are on its `request` span)
        tracing.record_span(f"queued {model}", parent, int(a.sent_ms * 1e6), now_ns,
                            {"shoal.model": model})
    attributes["messaging.operation.type"] = "process"
    held.span = tracing.tracer().start_span(f"request {model}", context=parent,
                                            kind=SpanKind.CONSUMER, attributes=attributes,
                                            start_time=now_ns)


def batch_started(model: str, batch: Batch, held: list[Held], started_s: float) -> None:
    """A batch starts: its span, linked to its requests' (see the module doc), each
    request's `batch started` event, and the context its runtime's spans continue
    (`batch_trace`)."""
    from opentelemetry import context, trace
    from opentelemetry.trace import Link

    started_ns = int(started_s * 1e9)
    tokens = batch_tokens(batch.members, batch.lane.limits.padded)
    spans = [h.span for h in held if h.span is not None]
    links = [Link(s.get_span_context()) for s in spans]
    parent = (trace.set_span_in_context(spans[0]) if len(held) == 1 and spans
              else context.Context())
    span = tracing.tracer().start_span(
        f"batch {model}", context=parent, links=links, start_time=started_ns,
        attributes={"shoal.model": model, "shoal.batch.requests": len(held),
                    "shoal.batch.items": sum(h.annotations.items for h in held),
                    "shoal.batch.tokens": tokens})
    _open_batches[id(batch)] = span
    # An unsampled batch's runtime stages are not stamped at all.
    traceparent = tracing.carrier_of(span)[0] if span.is_recording() else None
    for h in held:
        h.batch_trace = traceparent
        if h.span is not None and h.part == 0:
            h.span.add_event("batch started", {"shoal.hold_ms": round(
                started_s * 1000 - h.delivery.received * 1000, 3)}, timestamp=started_ns)


def batch_ended(batch: Batch, outcomes: list[Outcome] | None) -> None:
    """A batch ended (None: the runtime itself failed)."""
    from opentelemetry.trace import Status, StatusCode

    span = _open_batches.pop(id(batch), None)
    if span is None:
        return
    if outcomes is None:
        span.set_status(Status(StatusCode.ERROR, "the runtime failed"))
    else:
        span.set_attribute("shoal.batch.failed", sum(1 for o in outcomes if not o.ok))
    span.end()


def settled(held: Held, outcome: str) -> None:
    """A request was answered (`outcome`: ok, or its error code) or handed back
    (`returned`): its `request` span ends."""
    span, held.span = held.span, None
    if span is None:
        return
    if outcome != "ok":
        from opentelemetry.trace import Status, StatusCode

        if outcome != "returned":
            span.set_status(Status(StatusCode.ERROR, outcome))
    span.set_attribute("shoal.outcome", outcome)
    span.end(end_time=time.time_ns())
