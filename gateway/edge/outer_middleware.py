"""The gateway's outermost ASGI middleware: request ids, metrics, and the last word on errors.

Every response goes through here, so every response is counted by route and status,
an unexpected exception included: it is answered here (500 INTERNAL with the route's
error body) instead of by Starlette's ServerErrorMiddleware outside, which re-raised
it, so uvicorn logged a second traceback and dropped the keep-alive connection.
A client that leaves while its body is being read is one log line and a metric.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.edge.error_shapes import error_response
from gateway.edge.gateway_metrics import CLIENT_DISCONNECTS, LATENCY, REQUESTS, UNEXPECTED_ERRORS
from tasks.errors import ErrorCode, ShoalError
from tasks.ids import hex_id

log = logging.getLogger(__name__)

# X-Request-Id is echoed in a header and written to logs: only ids that cannot split a
# header or a log line, nor flood either, are kept.
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,%d}" % MAX_REQUEST_ID_CHARS)
# Set by gateway.edge.http_protocol when it answered the request itself (a body read timeout): the
# disconnect the app then sees is not the client's doing.
EDGE_ANSWERED = "shoal_edge_answered"

_FIXED_ROUTES = {"/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/models",
                 "/v1/jobs", "/healthz", "/readyz", "/metrics",
                 "/v1/rerank", "/v2/rerank", "/embed", "/rerank", "/predict"}
_MODEL_ROUTES = ("encode", "score", "extract", "classify")


def route_label(path: str) -> str:
    """A bounded metrics label: the route template, never a caller's path."""
    if path in _FIXED_ROUTES:
        return path
    for op in _MODEL_ROUTES:
        if path.startswith(f"/v1/{op}/"):
            return f"/v1/{op}/{{model}}"
    if path.startswith("/v1/jobs/"):
        return "/v1/jobs/{id}"
    return "other"


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The caller's X-Request-Id if it is a safe one (<= 128 of [A-Za-z0-9._:@/+=-]),
    else a fresh id: the request is served either way (an id is for tracing; refusing a
    request over a proxy's odd id would turn a cosmetic fault into an outage)."""
    for name, value in headers:
        if name == b"x-request-id":
            if _REQUEST_ID.fullmatch(value):
                return value.decode("ascii")
            break
    return hex_id()


def _redis_unreachable(exc: BaseException) -> bool:
    # By module and name, not class: redis is imported only once a job route needs it.
    return type(exc).__module__.startswith("redis") and type(exc).__name__ in (
        "ConnectionError", "TimeoutError", "BusyLoadingError")


def error_for_unexpected(exc: Exception) -> ShoalError:
    """What a caller is told about an exception no handler expected."""
    if _redis_unreachable(exc):  # the jobs' state: the caller may retry, nothing is lost
        return ShoalError(ErrorCode.JOB_STORE_UNAVAILABLE, "the job store (Redis, "
                          "SHOAL_REDIS_URL) is not reachable; retry later", retry_after=1)
    return ShoalError(ErrorCode.INTERNAL, "internal error; see the gateway's log")


# (route, status) -> its counter and latency histogram (labels() takes a lock)
_SERIES: dict[tuple[str, int], tuple[Any, Any]] = {}


def count_response(route: str, status: int, started: float) -> None:
    """Count a response by route and status, and its latency since `started`
    (perf_counter): this middleware's, and the hot path's (`gateway.edge.hot_requests`)."""
    key = (route, status)
    series = _SERIES.get(key)
    if series is None:
        series = _SERIES[key] = (REQUESTS.labels(route, str(status)), LATENCY.labels(route))
    series[0].inc()
    series[1].observe(time.perf_counter() - started)


def report_unexpected(method: str, route: str, request_id: str, exc: Exception) -> ShoalError:
    """Log (and count) an exception no handler expected; what the caller is told."""
    error = error_for_unexpected(exc)
    if error.code == ErrorCode.JOB_STORE_UNAVAILABLE:
        log.warning("%s %s: Redis is not reachable: %s", method, route, exc)
    else:
        UNEXPECTED_ERRORS.labels(route).inc()
        log.error("unexpected error on %s %s (request %s)", method, route, request_id,
                  exc_info=exc)
    return error


def report_client_left(method: str, route: str, request_id: str) -> None:
    """The client left mid-body: nobody to answer, nothing the gateway did wrong."""
    CLIENT_DISCONNECTS.labels(route).inc()
    log.warning("%s %s: the client disconnected before its body was read "
                "(request %s)", method, route, request_id)


def shutdown_error() -> ShoalError:
    """What a request still unanswered when the shutdown's grace ran out is told."""
    return ShoalError(ErrorCode.SHUTTING_DOWN, "the gateway shut down before this request "
                      "was answered (its grace ran out); retry it", retry_after=1)


class RequestIdMiddleware:
    """Echo or assign X-Request-Id, count every response by route and status, and answer
    what escaped every handler."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["arrived"] = time.time()  # epoch: where a request's trace starts
        started = time.perf_counter()
        route = route_label(scope["path"])
        response_started = False

        async def send_with_id(message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("ascii")))
                message["headers"] = headers
                count_response(route, message["status"], started)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            # gateway.edge.http_protocol timed the body out and said so
            if state.get(EDGE_ANSWERED):
                return
            report_client_left(scope["method"], route, request_id)
        except Exception as exc:
            await self._unexpected(scope, exc, route, request_id, response_started,
                                   send_with_id)
        except asyncio.CancelledError:
            # uvicorn cancels what is still in flight when SHOAL_SHUTDOWN_GRACE_S ran out:
            # an answer that says so, instead of uvicorn's plain-text 500 and a traceback.
            if response_started:
                raise
            await _answer(scope, shutdown_error(), send_with_id)

    async def _unexpected(self, scope, exc: Exception, route: str, request_id: str,
                          response_started: bool, send) -> None:
        error = report_unexpected(scope["method"], route, request_id, exc)
        if response_started:
            # Part of a response went out (a stream): it cannot become an error now.
            # Returning with it incomplete makes uvicorn close the connection, so the
            # client sees it cut short rather than a response that looks whole.
            return
        await _answer(scope, error, send)


async def _answer(scope, error: ShoalError, send) -> None:
    await error_response(Request(scope), error)(scope, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}
