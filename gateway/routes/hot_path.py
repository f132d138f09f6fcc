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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.edge import error_shapes
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
