"""The test process's tracer provider: the SDK's, exporting to memory (`TRACES`).

OpenTelemetry takes one global provider per process; the first test module that imports
this sets it. Tests clear `TRACES` first and read `finished()`; they turn tracing on
with `monkeypatch.setattr(tasks.tracing, "ENABLED", True)`.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

TRACES = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(TRACES))
trace.set_tracer_provider(_provider)


def finished() -> list[Any]:
    """The spans ended since `TRACES.clear()`."""
    return list(TRACES.get_finished_spans())
