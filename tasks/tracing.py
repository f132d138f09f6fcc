"""OpenTelemetry tracing: off unless an exporter is configured, and free when off.

The switch is the standard environment, read once per process (`ENABLED`): tracing is on
when `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`; `none` is off), or,
without it, when an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT`); `OTEL_SDK_DISABLED=true` turns it off whatever else is
set. (The SDK's own default exporter is `otlp`: shoal does not trace a process nobody
asked it to, so an unset environment is off.) Off, nothing of OpenTelemetry is imported
and each hook on a hot path is one test of `ENABLED`.

On, `setup` gives the process the SDK's tracer provider: its resource from
`OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` (by default `shoal-<component>`), its
sampler from `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default: follow the
caller's decision, sample every root), a batch span processor (`OTEL_BSP_*`) per exporter,
and each OTLP exporter over `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` (`http/protobuf`, the
default, or `grpc`) with the rest of its `OTEL_EXPORTER_OTLP_*` settings.

A request's trace context crosses processes as W3C `traceparent` / `tracestate` strings
(`tasks.envelope.Annotations`, `runtimes.wire.frames.Run`): `context_of` reads them back,
`carrier_of` writes a span's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

TRACER_NAME = "shoal"
# What each process calls itself by default (OTEL_SERVICE_NAME overrides), and the resource
# attribute that names the component whatever the service is called.
COMPONENT_ATTRIBUTE = "shoal.component"


def switched_on(env: Mapping[str, str]) -> bool:
    """Whether `env` asks for traces (see the module doc)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporters(env)
    if exporters is not None:
        return bool(exporters)
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())


def _exporters(env: Mapping[str, str]) -> list[str] | None:
    """The exporters OTEL_TRACES_EXPORTER names (`none` left out), or None when unset."""
    value = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not value:
        return None
    return [name for name in (n.strip() for n in value.split(",")) if name and name != "none"]


ENABLED: bool = switched_on(os.environ)
_set_up = False


def setup(component: str, env: Mapping[str, str] | None = None, strict: bool = False) -> bool:
    """Give this process the SDK's tracer provider and exporters, once; False (nothing
    done) when tracing is off. `component`: gateway, worker or runtime. An exporter or
    protocol shoal does not take raises ValueError if `strict`, else is logged and the
    process runs untraced (its spans are the API's no-ops)."""
    global _set_up
    env = os.environ if env is None else env
    if not switched_on(env):
        return False
    if _set_up:
        return True
    try:
        exporters = exporters_of(env)
    except ValueError as exc:
        if strict:
            raise
        logging.getLogger(__name__).error("tracing is off in this process: %s", exc)
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes: dict[str, Any] = {COMPONENT_ATTRIBUTE: component, "process.pid": os.getpid()}
    if not env.get("OTEL_SERVICE_NAME") and "service.name=" not in env.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes[SERVICE_NAME] = f"shoal-{component}"
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _set_up = True
    return True


def exporters_of(env: Mapping[str, str]) -> list[Any]:
    """The span exporters `env` names (`otlp` when only an endpoint is set)."""
    names = _exporters(env)
    out: list[Any] = []
    for name in names if names is not None else ["otlp"]:
        if name == "otlp":
            out.append(_otlp_exporter(env))
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: shoal exports traces over 'otlp' or to "
                             f"the 'console', not {name!r}")
    return out


def _otlp_exporter(env: Mapping[str, str]) -> Any:
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: shoal exports traces over "
                         f"'http/protobuf' or 'grpc', not {protocol!r}")
    return OTLPSpanExporter()  # the endpoint, headers, timeout... from OTEL_EXPORTER_OTLP_*


def tracer() -> Any:
    """shoal's tracer, made once (`trace.get_tracer` costs ~17 µs a call, measured)."""
    global _tracer
    if _tracer is None:
        from opentelemetry import trace

        # Before `setup`, a proxy that follows the provider set later.
        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


_tracer: Any = None


def set_attribute(key: str, value: Any) -> None:
    """An attribute on the current span (none: nothing)."""
    from opentelemetry import trace

    trace.get_current_span().set_attribute(key, value)


def _propagator() -> Any:
    global _w3c
    if _w3c is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _w3c = TraceContextTextMapPropagator()
    return _w3c


_w3c: Any = None  # made once: a W3C propagator per call cost microseconds per request


def context_of(traceparent: str | None, tracestate: str | None = None) -> Any:
    """The OpenTelemetry context of a W3C trace context (None, or a malformed one: an
    empty context, so the span made in it starts a trace of its own)."""
    if not traceparent:
        from opentelemetry import context

        return context.Context()
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _propagator().extract(carrier)


def carrier_of(span: Any) -> tuple[str | None, str | None]:
    """A span's W3C trace context: (traceparent, tracestate or None); (None, None) for a
    span whose context is not valid."""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _propagator().inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent"), carrier.get("tracestate") or None


def record_span(name: str, parent: Any, start_ns: int, end_ns: int,
                attributes: Mapping[str, Any] | None = None, kind: Any = None,
                links: Sequence[Any] = ()) -> Any:
    """A span that already happened (its times measured before it was known to matter):
    started at `start_ns` and ended at `end_ns` (epoch nanoseconds) in context `parent`."""
    from opentelemetry.trace import SpanKind

    span = tracer().start_span(name, context=parent, kind=kind or SpanKind.INTERNAL,
                               attributes=attributes, links=links, start_time=start_ns)
    span.end(end_time=max(start_ns, end_ns))
    return span
