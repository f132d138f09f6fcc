"""LoRA naming on the OpenAI routes (/v1/embeddings, /v1/completions, /v1/chat/completions).

OpenAI clients can only name a model, so a LoRA rides in the name, as vLLM and
LoRAX users expect: `model: "base-id:lora-name"`, or a `lora` field beside
`model`. Either becomes the task's `options.lora`, which `ModelEntry.parse`
checks against the entry's adapters (404 LORA_NOT_FOUND naming them) before
anything is published. The native routes take `options.lora` as it is.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from starlette.requests import Request

from gateway.calls.model_call import served_model
from gateway.edge.api_errors import invalid
from tasks.catalog import ModelEntry


def split_model_name(name: str, served: Container[str]) -> tuple[str, str | None]:
    """(model id, LoRA name or None) that an OpenAI `model` value names.

    A served model id is that model, even if it contains ':'. Otherwise the name
    is cut at its last ':' when the part before is a served model id and the part
    after is not empty: 'BAAI/bge-small-en-v1.5:legal' -> ('BAAI/bge-small-en-v1.5',
    'legal'). Anything else comes back whole (and is a 404 MODEL_NOT_FOUND later).
    """
    if name in served:
        return name, None
    base, sep, lora = name.rpartition(":")
    if sep and lora and base in served:
        return base, lora
    return name, None


def openai_model(request: Request, body: dict[str, Any], op: str
                 ) -> tuple[ModelEntry, str | None]:
    """The served entry and the LoRA (or None) that an OpenAI body's `model` and `lora`
    name; 404 for a model that is not served, 422 for a wrong type or a conflict."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string")
    model_id, lora = split_model_name(model, request.app.state.served)
    entry = served_model(request, model_id, op)
    field = body.get("lora")
    if field is not None:
        if not isinstance(field, str) or not field:
            raise invalid("'lora' must be a non-empty string (a LoRA adapter's name)")
        if lora is not None and field != lora:
            raise invalid(f"'model' names the LoRA {lora!r} and 'lora' names {field!r}; "
                          "give one")
        lora = field
    return entry, lora
