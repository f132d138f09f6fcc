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

from gateway.codecs import encode_response, read_body
from gateway.errors import invalid
from gateway.submit import Reply, call_model, check_items, served_model, wire_items
from tasks.adapters import CLASSIFY, DENSE, ENCODE, EXTRACT, MULTIVECTOR, SCORE
from tasks.results import embedding_rows, multivector_rows, ranked
from tasks.schema import ParsedRequest


async def submit(request: Request, op: str) -> tuple[ParsedRequest, Reply]:
    """Check the body for the path's model and `op`, publish it, await the result."""
    entry = served_model(request, request.path_params["model"], op)
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    fields = {"items", "options"} | ({"query"} if op == SCORE else set())
    if not isinstance(body, dict):
        raise invalid(f"the body must be an object with {sorted(fields)}")
    unknown = set(body) - fields
    if unknown:
        raise invalid(f"unknown fields {sorted(unknown)}; allowed: {sorted(fields)}")
    kwargs = {"model": entry.id, **body}
    parsed = entry.parse(kwargs)  # served_model made sure the entry's operation is `op`
    check_items(request, parsed)
    kwargs["items"] = wire_items(parsed)
    return parsed, await call_model(request, entry, kwargs)


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


def _endpoint(op: str, shape: Callable[[ParsedRequest, dict[str, Any]], dict[str, Any]]
              ) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        parsed, reply = await submit(request, op)
        payload = {"model": reply.result["model"], **shape(parsed, reply.result),
                   "usage": reply.result["usage"]}
        return encode_response(request, payload, headers=reply.headers)

    endpoint.__name__ = op
    return endpoint


encode = _endpoint(ENCODE, _encode_payload)
score = _endpoint(SCORE, _score_payload)
extract = _endpoint(EXTRACT, _extract_payload)
classify = _endpoint(CLASSIFY, _classify_payload)
