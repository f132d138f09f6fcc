"""shoal's native API: POST /v1/{encode,score,extract,classify}/{model}.

Each takes `{"items": [...], "options": {...}}` (score adds `"query"`), checks
it with the same schema function the runtime uses, publishes it and shapes
the result. Images arrive raw in msgpack or base64 in JSON and travel on as
bytes; they are decoded only in the runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_call import Reply, call_model, check_items, served_model, wire_items
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import encode_response, read_body
from tasks.adapters import CLASSIFY, DENSE, ENCODE, EXTRACT, IMAGE, MULTIVECTOR, SCORE
from tasks.catalog import ModelEntry
from tasks.render import names
from tasks.results import embedding_rows, multivector_rows, ranked
from tasks.schema import ParsedRequest


async def read_native(request: Request, op: str) -> tuple[ModelEntry, dict[str, Any]]:
    """The path's model (one that performs `op`) and the body, checked for its fields."""
    entry = served_model(request, request.path_params["model"], op)
    body = await read_body(request, body_limit(request, entry))
    fields = {"items", "options"} | ({"query"} if op == SCORE else set())
    if not isinstance(body, dict):
        raise invalid(f"the body must be an object with {sorted(fields)}")
    unknown = set(body) - fields
    if unknown:
        raise invalid(f"unknown fields {names(unknown)}; allowed: {sorted(fields)}")
    return entry, body


def checked_kwargs(request: Request, entry: ModelEntry, body: dict[str, Any]
                   ) -> tuple[ParsedRequest, dict[str, Any]]:
    """A request body checked for `entry` (the same schema function the runtime uses, the
    gateway's limits), and the task kwargs it becomes."""
    kwargs = {"model": entry.id, **body}
    parsed = entry.parse(kwargs)  # served_model made sure the entry's operation is right
    check_items(request, parsed)
    kwargs["items"] = wire_items(parsed)
    return parsed, kwargs


async def submit(request: Request, op: str) -> tuple[ParsedRequest, Reply]:
    """Check the body for the path's model and `op`, publish it, await the result."""
    entry, body = await read_native(request, op)
    parsed, kwargs = checked_kwargs(request, entry, body)
    del body  # JSON: its base64 images; only the decoded bytes stay alive from here on
    return parsed, await call_model(request, entry, kwargs)


def body_limit(request: Request, entry: ModelEntry) -> int:
    """Models that take images accept bodies up to SHOAL_MAX_CLAIM_BODY_BYTES (their large
    images travel as claim checks, not through the broker); others SHOAL_MAX_BODY_BYTES."""
    settings = request.app.state.settings
    if IMAGE in entry.contract.inputs:
        return max(settings.max_claim_body_bytes, settings.max_body_bytes)
    return settings.max_body_bytes


def _encode_payload(parsed: ParsedRequest, result: dict[str, Any]) -> dict[str, Any]:
    output = result.get("output", DENSE)
    payload: dict[str, Any] = {"output": output}
    if output == DENSE:
        payload.update(dims=result["dims"], dtype=result["dtype"],
                       embeddings=embedding_rows(result))
    elif output == MULTIVECTOR:
        payload.update(dims=result["dims"], dtype=result["dtype"],
                       embeddings=multivector_rows(result))
    else:
        payload.update(vocab_size=result.get("vocab_size"), embeddings=result["embeddings"])
    return payload


def _score_payload(parsed: ParsedRequest, result: dict[str, Any]) -> dict[str, Any]:
    return {"results": ranked(result, parsed.options.top_n)}


def _extract_payload(parsed: ParsedRequest, result: dict[str, Any]) -> dict[str, Any]:
    return {"entities": result["entities"]}


def _classify_payload(parsed: ParsedRequest, result: dict[str, Any]) -> dict[str, Any]:
    return {"labels": result["labels"]}


def _endpoint(op: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        from gateway.routes.job_routes import (  # jobs import this module
            accept_native,
            prefers_async,
        )

        if prefers_async(request):  # RFC 7240: run it as a job, answer 202 + Location
            return await accept_native(request, op)
        parsed, reply = await submit(request, op)
        return encode_response(request, payload(op, parsed, reply.result),
                               headers=reply.headers)

    endpoint.__name__ = op
    return endpoint


_SHAPES = {ENCODE: _encode_payload, SCORE: _score_payload, EXTRACT: _extract_payload,
           CLASSIFY: _classify_payload}


def payload(op: str, parsed: ParsedRequest, result: dict[str, Any]) -> dict[str, Any]:
    """The sync route's response body for a result (a job's inline result too); generate's
    result as the runtime gave it (its choices per prompt)."""
    shape = _SHAPES.get(op)
    body = shape(parsed, result) if shape is not None else {"choices": result["choices"]}
    return {"model": result.get("model"), **body, "usage": result.get("usage")}


encode = _endpoint(ENCODE)
score = _endpoint(SCORE)
extract = _endpoint(EXTRACT)
classify = _endpoint(CLASSIFY)
