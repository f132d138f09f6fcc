"""shoal's native API: POST /v1/{encode,score,extract,classify}/{model}.

Each takes `{"items": [...], "options": {...}}` (score adds `"query"`), checks
it with the same schema function the runtime uses, publishes it and shapes
the result. Images arrive raw in msgpack or base64 in JSON and travel on as
bytes; they are decoded only in the runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_call import Reply, call_model
from gateway.calls.native_api import checked_kwargs, payload, read_native
from gateway.edge.codecs import encode_response
from gateway.routes.job_routes import accept_native, prefers_async
from tasks.adapters import CLASSIFY, ENCODE, EXTRACT, SCORE
from tasks.schema import ParsedRequest


async def submit(request: Request, op: str) -> tuple[ParsedRequest, Reply]:
    """Check the body for the path's model and `op`, publish it, await the result."""
    entry, body = await read_native(request, op)
    parsed, kwargs = checked_kwargs(request, entry, body)
    del body  # JSON: its base64 images; only the decoded bytes stay alive from here on
    return parsed, await call_model(request, entry, kwargs)


def _endpoint(op: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        if prefers_async(request):  # RFC 7240: run it as a job, answer 202 + Location
            return await accept_native(request, op)
        parsed, reply = await submit(request, op)
        return encode_response(request, payload(op, parsed, reply.result, arrays=True),
                               headers=reply.headers)

    endpoint.__name__ = op
    return endpoint


encode = _endpoint(ENCODE)
score = _endpoint(SCORE)
extract = _endpoint(EXTRACT)
classify = _endpoint(CLASSIFY)
