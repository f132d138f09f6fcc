"""POST /v1/embeddings, OpenAI-compatible (works with the official `openai` client).

`model` may name a LoRA adapter ("base:lora", or a `lora` field: `gateway.routes.lora_names`);
the response's `model` is the caller's. `input` may be token ids of the model's own
vocabulary (`gateway.calls.openai_input`)."""

from __future__ import annotations

import base64
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_call import call_model, check_items
from gateway.calls.openai_input import openai_input_items
from gateway.calls.vectors import dense_array
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import encode_response, read_body
from gateway.routes.lora_names import openai_model
from tasks.adapters import DENSE, ENCODE
from tasks.catalog import ModelEntry

ENCODING_FORMATS = ("float", "base64")


async def create_embeddings(request: Request) -> Response:
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    entry, kwargs = embeddings_task(request, body)
    reply = await call_model(request, entry, kwargs)
    return encode_response(request, embeddings_payload(body, reply.result),
                           headers=reply.headers)


def embeddings_task(request: Request, body: dict[str, Any]
                    ) -> tuple[ModelEntry, dict[str, Any]]:
    """The model's entry and the encode task's kwargs for a body, checked as this route
    checks it (an OpenAI batch line's body too: `gateway.routes.batch_endpoints`)."""
    entry, lora = openai_model(request, body, ENCODE)
    if entry.contract.outputs[0] != DENSE:
        raise invalid(f"{entry.id} gives {entry.contract.outputs[0]} embeddings; "
                      f"use POST /v1/encode/{entry.id}")
    # Strings and token ids (the model's own: `gateway.calls.openai_input`); empty refused.
    items = openai_input_items(body.get("input"))
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise invalid(f"'encoding_format' must be one of {list(ENCODING_FORMATS)}")
    # OpenAI's float and base64 formats are both float32, whatever the entry's default.
    options: dict[str, Any] = {"dtype": "float32"}
    if body.get("dimensions") is not None:
        options["dimensions"] = body["dimensions"]
    if lora is not None:
        options["lora"] = lora
    kwargs = {"model": entry.id, "items": items, "options": options}
    # 422 (404 for an unknown LoRA) before anything is published; the entry's defaults
    # (prompts, dims) apply.
    check_items(request, entry.parse(kwargs))
    return entry, kwargs


def embeddings_payload(body: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """This route's response body for a body checked by `embeddings_task` and its result."""
    encoding_format = body.get("encoding_format") or "float"
    data = []
    for index, row in enumerate(dense_array(result)):
        # float: the row itself (`encode_response` writes arrays); base64: its float32 bytes
        embedding: Any = (base64.b64encode(row.tobytes()).decode()
                          if encoding_format == "base64" else row)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = result["usage"]["tokens"]
    return {
        "object": "list",
        "data": data,
        "model": body["model"],  # as the caller named it, "base:lora" included
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
