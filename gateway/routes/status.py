"""GET /healthz, /readyz, /v1/models and /v1/models/{id}."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.auth.access import check_model_allowed
from gateway.broker.pool_view import Placement, worker_rows
from gateway.edge.api_errors import ApiError, invalid
from gateway.edge.codecs import encode_response
from gateway.routes.lora_names import split_model_name
from tasks.catalog import Catalog, ModelEntry
from tasks.errors import ErrorCode
from tasks.render import shown


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


def created_times(catalog: Catalog, served: Mapping[str, ModelEntry]) -> dict[str, int]:
    """Each served model's `created` (OpenAI's integer, epoch seconds): when its catalog
    entry was written (the file's mtime, which an image or a wheel keeps, so gateways of
    one deployment agree), else when this gateway started."""
    started = int(time.time())
    created = {}
    for model in served:
        origin = catalog.origin(model)
        try:
            created[model] = int(origin.stat().st_mtime) if origin is not None else started
        except OSError:
            created[model] = started
    return created


def _show_all(request: Request) -> bool:
    value = request.query_params.get("all")
    if value is None or value.lower() in ("false", "0", ""):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise invalid(f"the query parameter 'all' must be true or false, got {shown(value)}",
                  param="all")


async def list_models(request: Request) -> Response:
    """OpenAI's model list: the models some worker serves now, each followed by its LoRAs
    as models of their own ("base:lora", the name the OpenAI routes take); with `?all=true`
    every model this gateway accepts (a request for one no worker serves is refused 503
    MODEL_UNAVAILABLE, or waits for a worker with SHOAL_GATEWAY_UNSERVED=wait).

    "Serves now" is what the workers' latest pool states say (`gateway.broker.pool_view`,
    sent every SHOAL_POOL_STATE_INTERVAL_S and forgotten once stale): a worker consumes the
    model's queue, with the model resident, loading, or cold (it loads on the first
    request). `workers` says which; a model consumed only by workers that send no pool
    state (plain Celery workers) is listed with `?all=true`."""
    show_all = _show_all(request)
    pool = request.app.state.broker.pool
    now = time.monotonic()
    data: list[dict[str, Any]] = []
    for entry in request.app.state.served.values():
        placements = pool.placements(entry.id, now)
        if placements or show_all:
            data.extend(_objects(request, entry, placements))
    return encode_response(request, {"object": "list", "data": data})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{id}: the model (or "base:lora") as `/v1/models?all=true` lists it;
    404 MODEL_NOT_FOUND for any other id, 403 for one the caller's key may not use."""
    name = request.path_params["model"]
    served = request.app.state.served
    model, lora = split_model_name(name, served)
    check_model_allowed(request, model)  # 403 before anything says whether it exists
    entry = served.get(model)
    if entry is None or (lora is not None and lora not in _loras(entry)):
        raise ApiError(ErrorCode.MODEL_NOT_FOUND,
                       f"the model {shown(name)} does not exist here; GET /v1/models?all=true "
                       "lists the models this gateway serves", param="model")
    placements = request.app.state.broker.pool.placements(entry.id, time.monotonic())
    objects = _objects(request, entry, placements)
    return encode_response(request, next(o for o in objects if o["id"] == name))


def _loras(entry: ModelEntry) -> list[str]:
    return sorted(getattr(entry, "loras", None) or ())


def _objects(request: Request, entry: ModelEntry,
             placements: list[Placement]) -> list[dict[str, Any]]:
    """The model's entry in the list, then one per LoRA adapter (`workers` from the pool
    states: an empty list means no worker has announced it)."""
    created = request.app.state.model_created.get(entry.id, 0)
    loras = _loras(entry)
    objects = [{**_describe(entry, created), "loras": loras,
                "workers": worker_rows(placements)}]
    objects.extend({**_describe(entry, created), "id": f"{entry.id}:{name}",
                    "parent": entry.id, "lora": name, "workers": worker_rows(placements, name)}
                   for name in loras)
    return objects


def _describe(entry: ModelEntry, created: int) -> dict[str, Any]:
    return {
        "id": entry.id,
        "object": "model",
        "created": created,
        "owned_by": "shoal",
        "adapter": entry.adapter,
        "tasks": list(entry.tasks or ()),
        "inputs": sorted(entry.contract.inputs),
        "outputs": list(entry.contract.outputs),
        "dims": entry.dims,
        "max_seq_length": entry.max_seq_length,
        "description": entry.description,
    }
