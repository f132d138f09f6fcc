"""The hot routes answered from the HTTP edge's own callbacks: no ASGI task, no middleware.

A one-text `POST /v1/embeddings`, `/v1/encode/{model}` or `/v1/score/{model}` is most of a
gateway's traffic, and on the ASGI path most of its CPU went to the frameworks around
the handler: uvicorn's cycle and task, the middleware's coroutines and send wrappers,
Starlette's Response. Here `EdgeProtocol` (`gateway.edge.http_protocol`) takes such a
request at the end of its headers: `HotCycle` stands in for uvicorn's cycle, collects
the body in the parser's callbacks, then calls the route's sync core (the same checks
and task part as the ASGI route: `gateway.routes.hot_path` names them), whose awaitable
is the broker's wait for the reply (a task: the deadline cancels it); that task's
done-callback writes the whole response, status line, headers and body, in one write.

Kept as on the ASGI path, by the same functions: X-Request-Id in and out, the request
metrics (`gateway.edge.outer_middleware.count_response`), error bodies
(`gateway.edge.error_shapes`), 500 for an unexpected exception, 503 SHUTTING_DOWN when
uvicorn's grace ran out (the task is in uvicorn's tasks, the connection in its
connections: the SIGTERM drain waits for both), the caller-left revoke (the cycle's
scope, `gateway.edge.caller_left`), the edge's limits (its timers see this cycle as
uvicorn's), keep-alive and `connection: close`, Content-Length or chunked bodies, the
access log line when uvicorn's is on.

What goes on to the ASGI path instead (decided at the end of the headers, before any of
the body is read): any other route or method; HTTP/1.0; `Expect: 100-continue`; an
upgrade; a request pipelined behind one still unanswered; uvicorn's
`limit_concurrency` reached; a `root_path`; a gateway with API keys (their rate limits
await Redis) or tracing on (the server span is ASGI middleware); an `Origin` header with
SHOAL_CORS_ORIGINS set; `Prefer: respond-async` (a job). A request whose body turns out
to need an await before its publish (image URLs to fetch, images to upload as claims)
stays here: its awaitable is the ASGI route's own coroutine for the rest.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

import httptools
from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from gateway.edge.codecs import check_declared_size, too_large
from gateway.edge.error_shapes import error_response
from gateway.edge.gateway_metrics import EDGE_SERVED
from gateway.edge.outer_middleware import (
    EDGE_ANSWERED,
    count_response,
    report_client_left,
    report_unexpected,
    request_id_of,
    route_label,
    shutdown_error,
)
from tasks.errors import ShoalError

log = logging.getLogger(__name__)

# route label -> its EDGE_SERVED child (labels() takes a lock)
_SERVED: dict[str, Any] = {}

# What a route's answer is: status, body, its media type, the response's headers.
Answer = tuple[int, bytes, str, dict[str, str]]


class HotRoute(Protocol):
    def begin(self, request: Request) -> tuple[int, Any]:
        """At the end of the headers: the most body the route reads, and what `start`
        gets with the body (a ShoalError is answered at once)."""

    def start(self, request: Request, raw: bytes, context: Any
              ) -> tuple[Awaitable[Any], Callable[[Any], Answer]]:
        """The whole body: checked and handed on; what to await, and what turns its
        result into the answer."""


class HotRouter(Protocol):
    def route(self, path: str, headers: list[tuple[bytes, bytes]]
              ) -> tuple[HotRoute, dict[str, str]] | None:
        """The route of a POST to `path` (and its path parameters), or None: ASGI."""


# The app uvicorn serves (a Starlette app, perhaps behind uvicorn's own wrappers) -> its
# hot routes. Weak: a test process builds many apps.
_ROUTERS: weakref.WeakKeyDictionary[Any, HotRouter] = weakref.WeakKeyDictionary()


def serve_hot(app: Any, router: HotRouter) -> None:
    """Answer `router`'s routes from the edge for connections that serve `app`."""
    _ROUTERS[app] = router


def router_of(app: Any) -> tuple[Any, HotRouter] | None:
    """The Starlette app inside what uvicorn serves, and its hot routes; None: none."""
    for _ in range(8):  # uvicorn's wrappers (proxy headers, message logger) hold `.app`
        if app is None:
            return None
        try:
            router = _ROUTERS.get(app)
        except TypeError:  # not weakly referable: no app of ours
            router = None
        if router is not None:
            return app, router
        app = getattr(app, "app", None)
    return None


def take(protocol: Any, hot: tuple[Any, HotRouter]) -> bool:
    """At the end of a request's headers: serve it here (True) or leave it to uvicorn."""
    parser = protocol.parser
    if (parser.get_method() != b"POST" or protocol.expect_100_continue
            or parser.get_http_version() != "1.1" or parser.should_upgrade()
            or protocol.root_path):
        return False
    existing = protocol.cycle
    if existing is not None and not existing.response_complete:
        return False  # pipelined: uvicorn queues it behind the one in flight
    limit = protocol.limit_concurrency
    if limit is not None and (len(protocol.connections) >= limit or len(protocol.tasks) >= limit):
        return False
    parsed = httptools.parse_url(protocol.url)
    raw_path = parsed.path
    path = raw_path.decode("ascii")
    if "%" in path:
        path = urllib.parse.unquote(path)
    app, router = hot
    scope = protocol.scope
    found = router.route(path, scope["headers"])
    if found is None:
        return False
    route, params = found
    scope["method"] = "POST"
    scope["path"] = path
    scope["raw_path"] = raw_path
    scope["query_string"] = parsed.query or b""
    scope["app"] = app
    scope["path_params"] = params
    # A keep-alive timer armed by an answer given inside this same read would run on.
    protocol._unset_keepalive_if_required()
    cycle = HotCycle(protocol, scope, route, parser.should_keep_alive())
    protocol.cycle = cycle
    cycle.begin()
    return True


class _NoEvent:
    """uvicorn's `message_event`, which wakes an ASGI app waiting for its body: none here."""

    __slots__ = ()

    def set(self) -> None:
        pass


class HotCycle:
    """One hot request on its connection, where uvicorn's RequestResponseCycle would be
    (`EdgeProtocol` and uvicorn read the same attributes of either)."""

    __slots__ = ("_chunks", "_context", "_limit", "_size", "disconnected", "keep_alive",
                 "label", "more_body", "protocol", "request", "request_id",
                 "response_complete", "response_started", "route", "scope", "started",
                 "transport")
    message_event = _NoEvent()

    def __init__(self, protocol: Any, scope: dict[str, Any], route: HotRoute,
                 keep_alive: bool) -> None:
        self.protocol = protocol
        self.transport = protocol.transport
        self.scope = scope
        self.route = route
        self.keep_alive = keep_alive
        self.more_body = True
        self.response_started = self.response_complete = self.disconnected = False
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = 0
        self._context: Any = None
        # As `RequestIdMiddleware` stamps every request.
        self.request_id = request_id_of(scope["headers"])
        state = scope["state"]
        state["request_id"] = self.request_id
        state["arrived"] = time.time()
        self.started = time.perf_counter()
        self.label = route_label(scope["path"])
        self.request = Request(scope)  # a view of the scope for the routes' checks

    def begin(self) -> None:
        try:
            self._limit, self._context = self.route.begin(self.request)
            check_declared_size(self.request, self._limit)
        except Exception as exc:
            self._failed(exc)

    def on_body(self, data: bytes) -> None:
        if self.response_started:  # answered early (413, 404): the rest is discarded
            return
        self._size += len(data)
        if self._size > self._limit:
            self._chunks = []
            self._answer_error(too_large(self._limit))
            return
        self._chunks.append(data)

    def on_message_complete(self) -> None:
        self.more_body = False
        if self.response_started:
            return
        raw = b"".join(self._chunks)
        self._chunks = []
        try:
            waiting, finish = self.route.start(self.request, raw, self._context)
        except Exception as exc:
            self._failed(exc)
            return
        protocol = self.protocol
        task = protocol.loop.create_task(waiting)
        protocol.tasks.add(task)  # uvicorn's shutdown waits for it, then cancels it
        task.add_done_callback(partial(self._replied, finish))

    def lost(self) -> None:
        """The connection was lost (`EdgeProtocol.connection_lost`)."""
        if self.more_body and not self.response_started and \
                not self.scope["state"].get(EDGE_ANSWERED):
            report_client_left("POST", self.label, self.request_id)

    # --- answers --------------------------------------------------------------------------

    def _replied(self, finish: Callable[[Any], Answer], task: Any) -> None:
        self.protocol.tasks.discard(task)
        if task.cancelled():  # by uvicorn, its grace over: nothing else cancels it
            self._answer_error(shutdown_error())
            return
        exc = task.exception()
        if exc is not None:
            self._failed(exc)
            return
        try:
            status, body, kind, headers = finish(task.result())
        except Exception as exc:
            self._failed(exc)
            return
        # As Starlette's Response writes them: the route's headers, then length and type.
        raw = [(name.lower().encode("latin-1"), value.encode("latin-1"))
               for name, value in headers.items()]
        raw.append((b"content-length", b"%d" % len(body)))
        raw.append((b"content-type", kind.encode("latin-1")))
        self._write(status, raw, body)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, ShoalError):
            self._answer_error(exc)
        elif isinstance(exc, Exception):
            self._answer_error(report_unexpected("POST", self.label, self.request_id, exc))
        else:
            raise exc

    def _answer_error(self, error: ShoalError) -> None:
        response = error_response(self.request, error, {"X-Request-Id": self.request_id})
        raw = [h for h in response.raw_headers if h[0] != b"x-request-id"]
        self._write(response.status_code, raw, response.body)

    def _write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole response in one write, headers as uvicorn writes them (its defaults
        first; the request id last, as the outer middleware appends it)."""
        count_response(self.label, status, self.started)
        served = _SERVED.get(self.label)
        if served is None:
            served = _SERVED[self.label] = EDGE_SERVED.labels(self.label)
        served.inc()
        self.response_started = True
        if self.disconnected:  # nobody to write to (counted, as the ASGI path counts it)
            self.response_complete = True
            return
        protocol = self.protocol
        if protocol.access_log:
            protocol.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(self.scope),
                                        "POST", get_path_with_query_string(self.scope),
                                        "1.1", status)
        content = [STATUS_LINE[status]]
        for name, value in protocol.server_state.default_headers:
            content += (name, b": ", value, b"\r\n")
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        content += (b"x-request-id: ", self.request_id.encode("ascii"), b"\r\n")
        if not self.keep_alive:  # the client asked, or uvicorn is shutting down
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        self.transport.write(b"".join(content))
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        protocol.on_response_complete()
