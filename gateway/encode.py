"""POST /v1/encode/{model}: shoal's native embedding API over `items`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.codecs import encode_response, read_body
from gateway.errors import invalid
from gateway.submit import call_model, check_texts, served_model
from tasks.errors import ShoalError
from tasks.results import embedding_arrays
from tasks.schema import parse_encode


async def encode(request: Request) -> Response:
    entry = served_model(request, request.path_params["model"])
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise invalid("the body must be an object with 'items' (and optional 'options')")
    unknown = set(body) - {"items", "options"}
    if unknown:
        raise invalid(f"unknown fields {sorted(unknown)}; allowed: ['items', 'options']")
    kwargs = {"model": entry.id, "items": body.get("items"), "options": body.get("options") or {}}
    try:
        parsed = parse_encode(kwargs, entry.dims)
    except ShoalError as exc:
        raise invalid(exc.message) from None
    check_texts(request, parsed.texts)
    reply = await call_model(request, entry, "encode", kwargs, parsed.texts)
    result = reply.result
    payload = {
        "model": entry.id,
        "dims": result["dims"],
        "embeddings": [row.tolist() for row in embedding_arrays(result)],
        "usage": result["usage"],
    }
    return encode_response(request, payload, headers=reply.headers)
