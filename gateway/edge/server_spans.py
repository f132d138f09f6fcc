"""The gateway's server spans, when tracing is on: one per HTTP request, outermost.

The hot routes (`POST /v1/embeddings`, `/v1/encode/{model}`, `/v1/score/{model}`: most
of the traffic, `gateway.routes.hot_path`) get a lean span of shoal's own: OpenTelemetry's
ASGI middleware costs ~280 µs of CPU per request on this project's 2-core machine
(its attributes from the scope, its metrics, its send wrapper), against ~50 µs for the
span alone, where a one-text request costs the whole stack ~800 µs. Every other route
goes through the ASGI middleware (`opentelemetry-instrumentation-asgi`) as it is. Both
continue a caller's W3C `traceparent`, name the span by its route template (never the
caller's path) and record the response's status.
"""

from __future__ import annotations

from typing import Any

from gateway.edge.outer_middleware import route_label
from tasks import tracing

# The route templates `HotRoutes` serves, POST only (`gateway.app.create_app`).
HOT_ROUTES = frozenset({"/v1/embeddings", "/v1/encode/{model}", "/v1/score/{model}"})


def span_details(scope: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A server span's name and route: `POST /v1/encode/{model}`, bounded like the
    metrics' labels."""
    route = route_label(scope.get("path", ""))
    return f"{scope.get('method', 'HTTP')} {route}", {"http.route": route}


class ServerSpans:
    """ASGI middleware: the server span of each HTTP request (see the module doc)."""

    def __init__(self, app: Any) -> None:
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
        from opentelemetry.trace import SpanKind

        self.app = app
        self.instrumented = OpenTelemetryMiddleware(app, default_span_details=span_details,
                                                    exclude_spans=["receive", "send"])
        self.kind = SpanKind.SERVER
        self.tracer = tracing.tracer()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        route = route_label(scope["path"]) if scope["type"] == "http" else ""
        if route not in HOT_ROUTES or scope["method"] != "POST":
            await self.instrumented(scope, receive, send)
            return
        traceparent = tracestate = None
        for name, value in scope["headers"]:
            if name == b"traceparent":
                traceparent = value.decode("latin-1")
            elif name == b"tracestate":
                tracestate = value.decode("latin-1")
        status = 0

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with self.tracer.start_as_current_span(
                f"POST {route}", context=tracing.context_of(traceparent, tracestate),
                kind=self.kind, attributes={"http.route": route,
                                            "http.request.method": "POST"}) as span:
            await self.app(scope, receive, send_status)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, str(status)))
