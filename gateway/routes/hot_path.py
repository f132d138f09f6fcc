"""The routes that carry most traffic, straight to their handlers.

`POST /v1/embeddings`, `/v1/encode/{model}` and `/v1/score/{model}` are most of what a
gateway serves. Starlette would take each through its exception middleware, its router
(a regular expression per route until one matches) and the wrapper that turns an
endpoint into an ASGI app, each a layer of coroutines and closures around the request
and every message it sends. `HotRoutes` sits just inside the gateway's own middleware
(request ids and metrics, API keys: those still see every request) and hands these
three to their handlers by a dictionary lookup and a prefix test; every other request,
and any other method on these paths, goes on to Starlette as before.

What a caller sees is the same either way: the same handlers, and errors answered by
the same functions Starlette's exception handlers call (`error_response`,
`http_error_response`). An exception no handler expects goes up to the outer
middleware, as it would from the router.

`EdgeRoutes` serves the same three routes from the HTTP edge itself, before any ASGI
(`gateway.edge.hot_requests`: no task, no middleware, no Response per request), with the
routes' own sync cores (`embeddings_call`, `check_fields` and `checked_kwargs`,
`gateway.calls.model_call.start_call`); what the edge leaves to ASGI still comes here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.image_inputs import fetch_images, image_rules
from gateway.calls.model_call import (
    Reply,
    call_model,
    reply_as_is,
    served_model,
    start_call,
)
from gateway.calls.native_api import body_limit, check_fields, checked_kwargs, payload
from gateway.edge import error_shapes
from gateway.edge.codecs import decode_body, encode_payload
from gateway.edge.hot_requests import Answer
from gateway.routes.embeddings import embeddings_body_limit, embeddings_call, embeddings_payload
from tasks.adapters import ENCODE, SCORE
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode, ShoalError

Endpoint = Callable[[Request], Awaitable[Response]]


def error_response(request: Request, error: ShoalError) -> Response:
    """The error response for `error` in its route's shape (`gateway.edge.error_shapes`),
    with the request's id."""
    return error_shapes.error_response(
        request, error, {"X-Request-Id": getattr(request.state, "request_id", "")})


def http_error_response(request: Request, exc: HTTPException) -> Response:
    """Starlette's 404 and 405 (and any other HTTPException) as any other error."""
    code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(
        exc.status_code, ErrorCode.INVALID_REQUEST
    )
    error = ShoalError(code, f"{request.method} {request.url.path}: {exc.detail}")
    error.status = exc.status_code
    return error_response(request, error)


class HotRoutes:
    """ASGI middleware: POSTs to `exact` paths, or to a `prefixed` path with a model after
    the prefix, go straight to their endpoint (see the module doc)."""

    def __init__(self, app: Any, exact: dict[str, Endpoint],
                 prefixed: dict[str, Endpoint]) -> None:
        self.app = app
        self.exact = exact
        self.prefixed = tuple(prefixed.items())

    def _endpoint(self, scope: dict[str, Any]) -> Endpoint | None:
        path = scope["path"]
        endpoint = self.exact.get(path)
        if endpoint is not None:
            return endpoint
        for prefix, endpoint in self.prefixed:
            if path.startswith(prefix) and len(path) > len(prefix):
                # As Starlette's `{model:path}` would: the rest of the (decoded) path.
                scope["path_params"] = {"model": path[len(prefix):]}
                return endpoint
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        endpoint = (self._endpoint(scope)
                    if scope["type"] == "http" and scope["method"] == "POST" else None)
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except ShoalError as exc:
            response = error_response(request, exc)
        except HTTPException as exc:
            response = http_error_response(request, exc)
        await response(scope, receive, send)


# --- the same routes from the HTTP edge ------------------------------------------------------

def _ok(request: Request, body: Any, headers: dict[str, str]) -> Answer:
    data, kind = encode_payload(request, body)
    return 200, data, kind, headers


async def _fetched_then_called(request: Request, entry: ModelEntry, kwargs: dict[str, Any],
                               urls: list[dict[str, Any]]) -> Reply:
    await fetch_images(urls, image_rules(request, entry))  # as `create_embeddings` does
    return await call_model(request, entry, kwargs)


class _Embeddings:
    """POST /v1/embeddings, as `gateway.routes.embeddings.create_embeddings`."""

    def begin(self, request: Request) -> tuple[int, Any]:
        return embeddings_body_limit(request), None

    def start(self, request: Request, raw: bytes, context: Any
              ) -> tuple[Awaitable[Any], Callable[[Any], Answer]]:
        body = decode_body(request, raw)
        entry, kwargs, urls = embeddings_call(request, body)
        if urls:
            waiting: Awaitable[Any] = _fetched_then_called(request, entry, kwargs, urls)
            finish: Callable[[Any], Reply] = reply_as_is
        else:
            waiting, finish = start_call(request, entry, kwargs)

        def answer(result: Any) -> Answer:
            reply = finish(result)
            return _ok(request, embeddings_payload(body, reply.result), reply.headers)

        return waiting, answer


class _Native:
    """POST /v1/{op}/{model}, as `gateway.routes.native` (not as a job: `Prefer:
    respond-async` stays on the ASGI path)."""

    def __init__(self, op: str) -> None:
        self.op = op
        # model -> (body limit, entry) of the models found served: the edge serves only
        # gateways without keys (nothing per caller to check), and the served models and
        # settings are fixed for the app's life. A model refused is looked up each time.
        self._found: dict[str, tuple[int, ModelEntry]] = {}

    def begin(self, request: Request) -> tuple[int, Any]:
        model = request.path_params["model"]
        found = self._found.get(model)
        if found is None:
            entry = served_model(request, model, self.op)
            found = self._found[model] = (body_limit(request, entry), entry)
        return found

    def start(self, request: Request, raw: bytes, entry: Any
              ) -> tuple[Awaitable[Any], Callable[[Any], Answer]]:
        body = check_fields(self.op, decode_body(request, raw))
        parsed, kwargs = checked_kwargs(request, entry, body)
        del body  # JSON: its base64 images; only the decoded bytes stay alive from here on
        waiting, finish = start_call(request, entry, kwargs)
        op = self.op

        def answer(result: Any) -> Answer:
            reply = finish(result)
            return _ok(request, payload(op, parsed, reply.result, arrays=True), reply.headers)

        return waiting, answer


class EdgeRoutes:
    """The hot routes for the HTTP edge (`gateway.edge.hot_requests.HotRouter`)."""

    def __init__(self, settings: Any) -> None:
        self.exact: dict[str, Any] = {"/v1/embeddings": _Embeddings()}
        self.prefixed = (("/v1/encode/", _Native(ENCODE)), ("/v1/score/", _Native(SCORE)))
        # With CORS on, a browser's request (it sends Origin) gets its headers from
        # Starlette's CORSMiddleware: the ASGI path.
        self.cors = bool(settings.cors_origins)

    def route(self, path: str, headers: list[tuple[bytes, bytes]]
              ) -> tuple[Any, dict[str, str]] | None:
        route = self.exact.get(path)
        params: dict[str, str] = {}
        native = route is None
        if native:
            for prefix, candidate in self.prefixed:
                if path.startswith(prefix) and len(path) > len(prefix):
                    route, params = candidate, {"model": path[len(prefix):]}
                    break
            else:
                return None
        prefer_seen = False
        for name, value in headers:
            if name == b"origin" and self.cors:
                return None
            if name == b"prefer" and native and not prefer_seen:
                prefer_seen = True  # the first one, as `prefers_async` reads it
                if b"respond-async" in value.lower():
                    return None
        return route, params
