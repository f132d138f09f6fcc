"""The native API's request and response shapes, shared by its sync routes
(`gateway.routes.native`), the jobs that run its requests in the background
(`gateway.routes.job_routes`) and the driver that answers an inline job
(`gateway.jobs.driver`): a body read and checked for its model, the task kwargs it
becomes, and a result shaped as the sync route answers it.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from gateway.calls.model_call import check_items, served_model, wire_items
from gateway.calls.vectors import dense_array
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import read_body
from tasks.adapters import CLASSIFY, DENSE, ENCODE, EXTRACT, IMAGE, MULTIVECTOR, SCORE
from tasks.catalog import ModelEntry
from tasks.render import names
from tasks.results import embedding_rows, multivector_rows, ranked
from tasks.schema import ParsedRequest


async def read_native(request: Request, op: str) -> tuple[ModelEntry, dict[str, Any]]:
    """The path's model (one that performs `op`) and the body, checked for its fields."""
    entry = served_model(request, request.path_params["model"], op)
    body = await read_body(request, body_limit(request, entry))
    return entry, check_fields(op, body)


def check_fields(op: str, body: Any) -> dict[str, Any]:
    """A decoded native body with no field but those of `op`."""
    fields = {"items", "options"} | ({"query"} if op == SCORE else set())
    if not isinstance(body, dict):
        raise invalid(f"the body must be an object with {sorted(fields)}")
    unknown = set(body) - fields
    if unknown:
        raise invalid(f"unknown fields {names(unknown)}; allowed: {sorted(fields)}")
    return body


def checked_kwargs(request: Request, entry: ModelEntry, body: dict[str, Any]
                   ) -> tuple[ParsedRequest, dict[str, Any]]:
    """A request body checked for `entry` (the same schema function the runtime uses, the
    gateway's limits), and the task kwargs it becomes."""
    kwargs = {"model": entry.id, **body}
    parsed = entry.parse(kwargs)  # served_model made sure the entry's operation is right
    check_items(request, parsed)
    kwargs["items"] = wire_items(parsed)
    return parsed, kwargs


def body_limit(request: Request, entry: ModelEntry) -> int:
    """Models that take images accept bodies up to SHOAL_MAX_CLAIM_BODY_BYTES (their large
    images travel as claim checks, not through the broker); others SHOAL_MAX_BODY_BYTES."""
    settings = request.app.state.settings
    if IMAGE in entry.contract.inputs:
        return max(settings.max_claim_body_bytes, settings.max_body_bytes)
    return settings.max_body_bytes


def _encode_payload(parsed: ParsedRequest, result: dict[str, Any],
                    arrays: bool = False) -> dict[str, Any]:
    output = result.get("output", DENSE)
    payload: dict[str, Any] = {"output": output}
    if output == DENSE:
        payload.update(dims=result["dims"], dtype=result["dtype"],
                       embeddings=dense_array(result) if arrays else embedding_rows(result))
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


_SHAPES = {SCORE: _score_payload, EXTRACT: _extract_payload, CLASSIFY: _classify_payload}


def payload(op: str, parsed: ParsedRequest, result: dict[str, Any],
            arrays: bool = False) -> dict[str, Any]:
    """The sync route's response body for a result (a job's inline result too); generate's
    result as the runtime gave it (its choices per prompt). `arrays`: dense vectors as one
    numpy array (`gateway.calls.vectors`; `encode_response` writes it), not lists."""
    if op == ENCODE:
        body = _encode_payload(parsed, result, arrays)
    else:
        shape = _SHAPES.get(op)
        body = shape(parsed, result) if shape is not None else {"choices": result["choices"]}
    return {"model": result.get("model"), **body, "usage": result.get("usage")}
