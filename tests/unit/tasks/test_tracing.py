"""tasks.tracing: the switch, the SDK's setup from OTEL_*, and trace contexts in the envelope."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tasks import tracing
from tasks.envelope import (
    H_TRACEPARENT,
    H_TRACES,
    Annotations,
    Part,
    coalesce,
    read_annotations,
    read_coalesced,
    single_message,
    with_trace,
)

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TP2 = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "x"}, False),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, True),
])
def test_the_switch(env: dict[str, str], on: bool) -> None:
    assert tracing.switched_on(env) is on


def test_off_imports_nothing_of_opentelemetry() -> None:
    """Tracing off, the gateway's app and the worker's lifecycle load no OpenTelemetry."""
    code = ("import sys, gateway.app, app.worker.lifecycle.dispatcher, "
            "runtimes.child_side.pipeline, tasks.tracing as t; assert not t.ENABLED; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_exporters_follow_the_protocol() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    assert [type(e) for e in tracing.exporters_of(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})] == [HttpExporter]
    assert [type(e) for e in tracing.exporters_of(
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})] == [GrpcExporter]
    assert [type(e) for e in tracing.exporters_of(
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})] == [HttpExporter]
    with pytest.raises(ValueError, match="http/json"):
        tracing.exporters_of({"OTEL_TRACES_EXPORTER": "otlp",
                              "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ValueError, match="zipkin"):
        tracing.exporters_of({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_a_context_round_trips() -> None:
    from opentelemetry import trace

    context = tracing.context_of(TP, "vendor=1")
    span_context = trace.get_current_span(context).get_span_context()
    assert format(span_context.trace_id, "032x") == TP.split("-")[1]
    assert span_context.is_remote
    assert tracing.carrier_of(trace.NonRecordingSpan(span_context)) == (TP, "vendor=1")
    # A malformed traceparent is no context: a span made in it starts its own trace.
    assert not trace.get_current_span(tracing.context_of("00-zz")).get_span_context().is_valid


def _annotations(traceparent: str | None = None, tracestate: str | None = None) -> Annotations:
    return Annotations("m", "encode", 1, 5, 5, 2_000_000_000_000, 1_000.5,
                       traceparent=traceparent, tracestate=tracestate)


def test_a_lone_message_carries_its_context_where_celery_does() -> None:
    message = single_message(Part("t1", _annotations(TP, "v=1"), b""), "origin")
    assert message.headers[H_TRACEPARENT] == TP and message.headers["tracestate"] == "v=1"
    read = read_annotations(message.headers)
    assert read is not None and (read.traceparent, read.tracestate) == (TP, "v=1")
    untraced = single_message(Part("t2", _annotations(), b""), "origin")
    assert H_TRACEPARENT not in untraced.headers
    # Junk in the header is ignored, never a refusal.
    assert read_annotations({**message.headers, H_TRACEPARENT: 7}).traceparent is None  # type: ignore[union-attr]


def test_each_coalesced_member_keeps_its_own_context() -> None:
    parts = [Part("a", _annotations(TP), b"x"), Part("b", _annotations(), b"y"),
             Part("c", _annotations(TP2, "k=v"), b"z")]
    message = coalesce("m", "encode", parts, "origin")
    assert H_TRACEPARENT not in message.headers  # each its own, none for the message
    read = read_coalesced(message.headers, message.body)
    assert [(p.annotations.traceparent, p.annotations.tracestate) for p in read] == [
        (TP, None), (None, None), (TP2, "k=v")]
    # An untraced message has no such header; a malformed one is ignored.
    assert H_TRACES not in coalesce("m", "encode", parts[1:2] * 2, "o").headers
    bad = {**message.headers, H_TRACES: [["x"], 3, None]}
    assert all(p.annotations.traceparent is None for p in read_coalesced(bad, message.body))


def test_a_celery_clients_headers_give_their_context() -> None:
    bare = _annotations()
    assert with_trace(bare, {H_TRACEPARENT: TP}).traceparent == TP
    assert with_trace(bare, {}) is bare


def test_a_wrong_exporter_stops_a_strict_process_and_leaves_another_untraced(caplog):
    wrong = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    with pytest.raises(ValueError, match="http/protobuf"):
        tracing.setup("gateway", wrong, strict=True)
    assert tracing.setup("worker", wrong) is False
    assert "tracing is off in this process" in caplog.text
    assert tracing.setup("worker", {}) is False  # off: nothing set up
