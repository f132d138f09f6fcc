"""GET /healthz, /readyz and /v1/models."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.broker.pool_view import worker_rows
from gateway.edge.api_errors import ApiError
from gateway.edge.codecs import encode_response
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode


async def healthz(request: Request) -> Response:
    return encode_response(request, {"status": "ok"})


async def readyz(request: Request) -> Response:
    drain = getattr(request.app.state, "drain", None)
    if drain is not None and drain.draining:
        raise ApiError(ErrorCode.SHUTTING_DOWN, "this gateway is draining (SIGTERM): it "
                       "answers what is in flight and takes nothing new")
    if not request.app.state.broker.ready:
        raise ApiError(ErrorCode.BROKER_UNAVAILABLE, "not connected to the message broker yet",
                       retry_after=1)
    return encode_response(request, {"status": "ready"})


async def list_models(request: Request) -> Response:
    """OpenAI's model list: every model this gateway serves, then each of its LoRAs as a
    model of its own ("base:lora", the name the OpenAI routes take). `workers` says
    where each is, from the workers' latest pool states (`gateway.broker.pool_view`): an empty list
    means no worker has announced it, not that none consumes its queue."""
    pool = request.app.state.broker.pool
    now = time.monotonic()
    data: list[dict[str, Any]] = []
    for entry in request.app.state.served.values():
        placements = pool.placements(entry.id, now)
        loras = sorted(getattr(entry, "loras", None) or ())
        data.append({**_describe(entry), "loras": loras, "workers": worker_rows(placements)})
        data.extend({**_describe(entry), "id": f"{entry.id}:{name}", "parent": entry.id,
                     "lora": name, "workers": worker_rows(placements, name)}
                    for name in loras)
    return encode_response(request, {"object": "list", "data": data})


def _describe(entry: ModelEntry) -> dict[str, Any]:
    return {
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
