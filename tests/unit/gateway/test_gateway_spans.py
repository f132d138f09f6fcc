"""The gateway's spans (`gateway.edge.tracing`, `gateway.edge.server_spans`), read from the
SDK's in-memory exporter: the server spans, the hot routes' (which bypass Starlette's
router) and the others', named by the route template and continuing the caller's
traceparent; the publish span whose context the request carries, ended by the broker's
confirm."""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient

from gateway.edge.api_errors import ApiError
from gateway.edge.server_spans import ServerSpans
from gateway.edge.tracing import call_span, publish_span
from gateway.routes.hot_path import HotRoutes
from tasks import tracing
from tasks.envelope import Annotations, Part
from tasks.errors import ErrorCode
from tests.tracing_memory import TRACES, finished

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _part() -> Part:
    return Part("task-1", Annotations("m", "encode", 3, 12, 5, 2_000_000_000_000, 1.0,
                                      lora="fr"), b"")


async def _encode(request: Request) -> Response:
    call_span(_part())
    return JSONResponse({"ok": True})


async def _elsewhere(scope, receive, send) -> None:
    await JSONResponse({"route": "starlette"})(scope, receive, send)


def test_server_spans_are_named_by_route_in_the_callers_trace_hot_routes_or_not():
    TRACES.clear()
    hot = HotRoutes(_elsewhere, exact={}, prefixed={"/v1/encode/": _encode})
    client = TestClient(ServerSpans(hot))
    response = client.post("/v1/encode/org/model-a", json={}, headers={"traceparent": CALLER})
    assert response.json() == {"ok": True}
    assert client.get("/v1/models", headers={"traceparent": CALLER}).json() == {
        "route": "starlette"}
    encode, models = finished()  # no receive/send spans
    for span in (encode, models):
        assert span.kind == trace.SpanKind.SERVER
        assert format(span.context.trace_id, "032x") == CALLER.split("-")[1]
        assert format(span.parent.span_id, "016x") == CALLER.split("-")[2]
    # The hot route's lean span (shoal's), never the caller's path:
    assert encode.name == "POST /v1/encode/{model}"
    assert encode.attributes["http.route"] == "/v1/encode/{model}"
    assert encode.attributes["http.response.status_code"] == 200
    assert encode.attributes["shoal.model"] == "m" and encode.attributes["shoal.items"] == 3
    assert encode.attributes["shoal.tokens"] == 12 and encode.attributes["shoal.lora"] == "fr"
    # Any other route: OpenTelemetry's ASGI middleware, named the same way.
    assert models.name == "GET /v1/models"
    assert models.attributes["http.route"] == "/v1/models"


def test_the_publish_span_is_what_the_message_carries_and_ends_at_the_confirm():
    TRACES.clear()

    async def run() -> tuple[Part, Part]:
        loop = asyncio.get_running_loop()
        with tracing.tracer().start_as_current_span("server"):
            ok, refused = loop.create_future(), loop.create_future()
            first = publish_span("m", "shoal.m", _part(), ok)
            second = publish_span("m", "shoal.m", _part(), refused)
        assert not [s for s in finished() if s.name == "publish m"]  # until confirmed
        # The spans' callbacks run on the loop, in order: these after them.
        ended = asyncio.Event()
        refused.add_done_callback(lambda _: ended.set())
        ok.set_result(None)
        refused.set_exception(ApiError(ErrorCode.QUEUE_FULL, "full"))
        refused.exception()
        await asyncio.wait_for(ended.wait(), 5)
        return first, second

    first, second = asyncio.run(run())
    spans = {s.context.span_id: s for s in finished() if s.name == "publish m"}
    server = next(s for s in finished() if s.name == "server")
    assert len(spans) == 2
    for part in (first, second):
        span_id = part.annotations.traceparent.split("-")[2]
        span = spans[int(span_id, 16)]
        assert span.kind == trace.SpanKind.PRODUCER
        assert span.parent.span_id == server.context.span_id
        assert span.attributes["messaging.destination.name"] == "shoal.m"
    assert spans[int(first.annotations.traceparent.split("-")[2], 16)].status.is_ok
    refused_span = spans[int(second.annotations.traceparent.split("-")[2], 16)]
    assert refused_span.attributes["shoal.error_code"] == "QUEUE_FULL"
    assert not refused_span.status.is_ok


def test_a_trace_not_sampled_publishes_no_span_and_passes_the_decision_on():
    TRACES.clear()
    unsampled = trace.NonRecordingSpan(trace.SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=False,
        trace_flags=trace.TraceFlags(0)))

    async def run() -> Part:
        with trace.use_span(unsampled):
            return publish_span("m", "shoal.m", _part(), asyncio.get_running_loop().create_future())

    part = asyncio.run(run())
    assert part.annotations.traceparent == (
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")
    assert finished() == []
