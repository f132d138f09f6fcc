"""GET /healthz, /readyz and /v1/models."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.codecs import encode_response
from gateway.errors import ApiError
from tasks.errors import ErrorCode


async def healthz(request: Request) -> Response:
    return encode_response(request, {"status": "ok"})


async def readyz(request: Request) -> Response:
    if not request.app.state.broker.ready:
        raise ApiError(ErrorCode.BROKER_UNAVAILABLE, "not connected to the message broker yet",
                       retry_after=1)
    return encode_response(request, {"status": "ready"})


async def list_models(request: Request) -> Response:
    data = [
        {
            "id": entry.id,
            "object": "model",
            "owned_by": "shoal",
            "adapter": entry.adapter,
            "tasks": list(entry.tasks or ()),
            "inputs": sorted(entry.contract.inputs),
            "outputs": list(entry.contract.outputs),
            "dims": entry.dims,
            "max_seq_length": entry.max_seq_length,
            "description": entry.description,
        }
        for entry in request.app.state.served.values()
    ]
    return encode_response(request, {"object": "list", "data": data})
