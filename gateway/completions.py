"""POST /v1/completions and /v1/chat/completions, OpenAI-compatible (non-streaming).

The body is mapped onto a generate task: each prompt (or the chat) is an
item, the sampling parameters are options. Parameters shoal does not
implement are refused with a 422 naming them, unless they carry their
neutral value, so a caller never gets silently different behaviour. `model` may
name a LoRA adapter ("base:lora", or a `lora` field: `gateway.lora`); the
response's `model` is the caller's.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.codecs import encode_response, read_body
from gateway.errors import invalid
from gateway.lora import openai_model
from gateway.submit import call_model, check_items
from tasks.adapters import GENERATE

# OpenAI name -> shoal option name.
_OPTIONS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
            "temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "seed"}
# Accepted only with the value that means "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "stream": (None, False), "echo": (None, False), "logprobs": (None, False),
    "top_logprobs": (None, 0), "suffix": (None, ""), "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}), "stream_options": (None,),
    "parallel_tool_calls": (None, True, False),
}
_IGNORED = {"user", "metadata", "store", "service_tier"}


def _options(body: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    unknown = set(body) - allowed - set(_OPTIONS) - set(_NEUTRAL) - _IGNORED
    if unknown:
        raise invalid(f"unknown fields {sorted(unknown)}")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            hint = "; streaming is not supported yet" if name == "stream" else ""
            raise invalid(f"'{name}' is not supported here (leave it out){hint}")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise invalid("give 'max_tokens' or 'max_completion_tokens', not both")
    return {_OPTIONS[k]: v for k, v in body.items() if k in _OPTIONS and v is not None}


def _message_text(content: Any, index: int) -> str:
    """A message's content; OpenAI's list-of-parts form is joined when all parts are text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(f"messages[{index}].content must be a string or a list of text parts")


async def _generate(request: Request, body: Any, items: list[dict[str, Any]],
                    allowed: set[str]
                    ) -> tuple[dict[str, Any], dict[str, str], list[dict[str, Any]]]:
    entry, lora = openai_model(request, body, GENERATE)
    options = _options(body, allowed | {"lora"})
    if lora is not None:
        options["lora"] = lora
    kwargs = {"model": entry.id, "items": items, "options": options}
    check_items(request, entry.parse(kwargs))  # 404 for an unknown LoRA, unpublished
    reply = await call_model(request, entry, kwargs)
    usage = reply.result["usage"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }, reply.headers, reply.result["choices"]


async def _body(request: Request) -> dict[str, Any]:
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


async def create_completion(request: Request) -> Response:
    body = await _body(request)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(
        isinstance(p, str) for p in prompts
    ):
        raise invalid("'prompt' must be a string or a non-empty list of strings "
                      "(token-id prompts are not supported)")
    usage, headers, choices = await _generate(
        request, body, [{"text": p} for p in prompts], {"model", "prompt"})
    payload = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body["model"],  # as the caller named it, "base:lora" included
        "choices": [{"index": c["index"], "text": c["text"], "logprobs": None,
                     "finish_reason": c["finish_reason"]} for c in choices],
        "usage": usage,
    }
    return encode_response(request, payload, headers=headers)


async def create_chat_completion(request: Request) -> Response:
    body = await _body(request)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) for m in messages
    ):
        raise invalid("'messages' must be a non-empty list of {'role', 'content'}")
    # OpenAI's newer name for the system role.
    wire = [{"role": "system" if m.get("role") == "developer" else m.get("role"),
             "content": _message_text(m.get("content"), i)} for i, m in enumerate(messages)]
    usage, headers, choices = await _generate(
        request, body, [{"messages": wire}], {"model", "messages"})
    payload = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body["model"],  # as the caller named it, "base:lora" included
        "choices": [{"index": 0, "message": {"role": "assistant", "content": c["text"]},
                     "logprobs": None, "finish_reason": c["finish_reason"]} for c in choices],
        "usage": usage,
    }
    return encode_response(request, payload, headers=headers)
