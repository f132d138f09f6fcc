"""The gateway's spans, when tracing is on (`tasks.tracing.ENABLED`; nothing here runs, nor
is any of OpenTelemetry imported, when it is off).

- The server span of every HTTP request, outermost (`gateway.edge.server_spans`: a lean
  one of shoal's own for the hot routes, OpenTelemetry's ASGI middleware for the rest),
  named by the route template, continuing a caller's W3C `traceparent`.
- `call_span`: the request's model, LoRA, items, estimated tokens and deadline on that
  span (and `gateway.edge.error_shapes` puts any error answer's code there).
- `publish_span`: from the request entering its model's outbox to the broker's confirm
  (a producer span), and the trace context the request's task message carries: each
  request its own, coalesced or not (`tasks.envelope`).
- `reply_span`: from the worker handing the result to its reply publisher (a stamp in the
  result) to the gateway holding it.
- Redis commands (jobs' state, API keys' rate limits): OpenTelemetry's Redis
  instrumentation, a client span each inside the request's.

aio-pika's instrumentation is not used: it makes one span per message and writes one trace
context into it, where a coalesced message carries many requests, each with its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from gateway.edge.server_spans import ServerSpans
from tasks import tracing
from tasks.envelope import Annotations, Part


def install(app: Any) -> None:
    """Add the server spans' middleware, outermost (call after every other middleware)."""
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    tracing.setup("gateway", strict=True)  # a wrong OTEL_* stops the gateway at start
    RedisInstrumentor().instrument()  # jobs' state, keys' rate limits: a span per command
    app.add_middleware(ServerSpans)


def attributes_of(annotations: Annotations) -> dict[str, Any]:
    """What a span says of a request: model, operation, items (texts), estimated tokens,
    deadline, LoRA."""
    out: dict[str, Any] = {"shoal.model": annotations.model, "shoal.op": annotations.op,
                           "shoal.items": annotations.items,
                           "shoal.tokens": annotations.cost}
    if annotations.deadline_ms is not None:
        out["shoal.deadline_ms"] = annotations.deadline_ms
    if annotations.lora:
        out["shoal.lora"] = annotations.lora
    return out


def call_span(part: Part) -> None:
    """The request's attributes on the current (server) span."""
    from opentelemetry import trace

    span = trace.get_current_span()
    span.set_attributes(attributes_of(part.annotations))
    span.set_attribute("shoal.task_id", part.task_id)


def publish_span(model: str, queue: str, part: Part, confirmed: asyncio.Future[None]) -> Part:
    """A producer span from now (the request entering its outbox) to the broker's confirm
    (`confirmed` resolved, or failed, or cancelled: a caller that left); returns the request
    carrying the span's trace context, which is what its message carries. In a trace not
    sampled, no span: the request carries its server span's context (the decision with it),
    so that nothing downstream records either."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    current = trace.get_current_span()
    if not current.is_recording() and current.get_span_context().is_valid:
        return _carrying(part, current)
    # The request's own attributes are on the server span: each one more is encoded and
    # exported again per span.
    attributes = {"messaging.system": "rabbitmq", "messaging.operation.type": "send",
                  "messaging.destination.name": queue, "messaging.message.id": part.task_id}
    span = tracing.tracer().start_span(f"publish {model}", kind=SpanKind.PRODUCER,
                                       attributes=attributes)

    def done(future: asyncio.Future[None]) -> None:
        if future.cancelled():
            span.set_attribute("shoal.outcome", "withdrawn")
        elif (exc := future.exception()) is not None:
            code = str(getattr(exc, "code", None) or type(exc).__name__)
            span.set_attribute("shoal.error_code", code)
            span.set_status(Status(StatusCode.ERROR, code))
        span.end()

    confirmed.add_done_callback(done)
    return _carrying(part, span)


def _carrying(part: Part, span: Any) -> Part:
    traceparent, tracestate = tracing.carrier_of(span)
    return dataclasses.replace(part, annotations=dataclasses.replace(
        part.annotations, traceparent=traceparent, tracestate=tracestate))


def reply_span(timing: dict[str, Any] | None, replied_s: float) -> None:
    """The reply's way back, from the worker's stamp (`answered_us`) to `replied_s`."""
    answered_us = (timing or {}).get("answered_us")
    if not answered_us:
        return
    from opentelemetry import context, trace

    if not trace.get_current_span().is_recording():
        return  # a trace not sampled

    tracing.record_span("reply", context.get_current(), int(answered_us * 1000),
                        int(replied_s * 1e9),
                        {"messaging.system": "rabbitmq", "messaging.operation.type": "receive"})
