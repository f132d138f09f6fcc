"""POST /v1/embeddings, OpenAI-compatible (works with the official `openai` client).

`model` may name a LoRA adapter ("base:lora", or a `lora` field: `gateway.routes.lora_names`);
the response's `model` is the caller's. `input` may be token ids of the model's own
vocabulary (`gateway.calls.openai_input`), and, for a model that takes images (CLIP), images:
data URIs and `image_url` parts, or vLLM's `messages` (`gateway.calls.image_inputs`). Bodies
may be as large as SHOAL_MAX_CLAIM_BODY_BYTES for such a model, SHOAL_MAX_BODY_BYTES for
the others."""

from __future__ import annotations

import base64
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.image_inputs import (
    fetch_images,
    has_images,
    image_rules,
    openai_image_items,
    with_stand_ins,
)
from gateway.calls.model_call import call_model, check_items
from gateway.calls.native_api import body_limit
from gateway.calls.openai_input import openai_input_items
from gateway.calls.vectors import dense_array
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import check_body_size, encode_response, read_body
from gateway.routes.lora_names import openai_model
from tasks.adapters import DENSE, ENCODE
from tasks.catalog import ModelEntry

ENCODING_FORMATS = ("float", "base64")


async def create_embeddings(request: Request) -> Response:
    body = await read_body(request, embeddings_body_limit(request))
    entry, kwargs, urls = embeddings_call(request, body)
    if urls:  # image URLs on a listed host (SHOAL_IMAGE_URL_HOSTS)
        await fetch_images(urls, image_rules(request, entry))
    reply = await call_model(request, entry, kwargs)
    return encode_response(request, embeddings_payload(body, reply.result),
                           headers=reply.headers)


def embeddings_body_limit(request: Request) -> int:
    """The most body this route reads: images' models take more (checked once the body
    names its model)."""
    settings = request.app.state.settings
    return max(settings.max_body_bytes, settings.max_claim_body_bytes)


def embeddings_call(request: Request, body: Any
                    ) -> tuple[ModelEntry, dict[str, Any], list[dict[str, Any]]]:
    """A decoded body checked as this route checks it: the model's entry, the task's
    kwargs and the image URLs still to fetch (this route's sync core, which the HTTP
    edge's hot path calls too: `gateway.routes.hot_path`)."""
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    if request.state.body_bytes > request.app.state.settings.max_body_bytes:
        # allowed for images only
        check_body_size(request, body_limit(request, openai_model(request, body, ENCODE)[0]))
    urls: list[dict[str, Any]] = []
    entry, kwargs = embeddings_task(request, body, urls)
    return entry, kwargs, urls


def embeddings_task(request: Request, body: dict[str, Any],
                    urls: list[dict[str, Any]] | None = None
                    ) -> tuple[ModelEntry, dict[str, Any]]:
    """The model's entry and the encode task's kwargs for a body, checked as this route
    checks it (an OpenAI batch line's body too: `gateway.routes.batch_endpoints`). The items
    whose image URL is still to fetch go to `urls` (None: a URL is refused)."""
    entry, lora = openai_model(request, body, ENCODE)
    if entry.contract.outputs[0] != DENSE:
        raise invalid(f"{entry.id} gives {entry.contract.outputs[0]} embeddings; "
                      f"use POST /v1/encode/{entry.id}")
    # Strings and token ids (the model's own: `gateway.calls.openai_input`); empty refused.
    value = body.get("input")
    if has_images(value) or body.get("messages") is not None:  # a prefix test per string
        items = openai_image_items(request, entry, body, urls)
    else:
        items = openai_input_items(value)
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
    check_items(request, entry.parse(with_stand_ins(kwargs) if urls else kwargs))
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
