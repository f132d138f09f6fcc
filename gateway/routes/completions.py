"""POST /v1/completions and /v1/chat/completions, OpenAI-compatible.

The body is mapped onto a generate task: each prompt (or the chat) is an
item, the sampling parameters are options; a prompt may be token ids of the model's own
vocabulary, used as they are (`gateway.calls.openai_input`). `stream: true` answers with
server-sent events (`gateway.routes.streaming`). Parameters shoal does not
implement are refused with a 422 naming them, unless they carry their
neutral value, so a caller never gets silently different behaviour. `model` may
name a LoRA adapter ("base:lora", or a `lora` field: `gateway.routes.lora_names`); the
response's `model` is the caller's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.calls.model_call import Reply, call_model, check_items
from gateway.calls.openai_input import openai_input_items
from gateway.edge.api_errors import invalid
from gateway.edge.codecs import encode_response, read_body
from gateway.edge.gateway_metrics import INTER_TOKEN, TIME_TO_FIRST_TOKEN
from gateway.routes.lora_names import openai_model
from gateway.routes.streaming import ChunkFormat, stream_generation
from tasks.adapters import GENERATE
from tasks.catalog import ModelEntry
from tasks.render import names
from tasks.served import time_to_first_token_ms

# OpenAI name -> shoal option name.
_OPTIONS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
            "temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "seed"}
# Accepted only with the value that means "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "echo": (None, False), "logprobs": (None, False),
    "top_logprobs": (None, 0), "suffix": (None, ""), "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, True, False),
}
_STREAMING = {"stream", "stream_options"}
_IGNORED = {"user", "metadata", "store", "service_tier"}


def _options(body: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    unknown = set(body) - allowed - set(_OPTIONS) - set(_NEUTRAL) - _IGNORED - _STREAMING
    if unknown:
        raise invalid(f"unknown fields {names(unknown)}")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise invalid(f"'{name}' is not supported here (leave it out)")
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


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise invalid("'stream' must be true or false")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            options.get("include_usage") not in (None, True, False):
        raise invalid("'stream_options' takes one field, include_usage (true or false)")
    return True, bool(options.get("include_usage"))


def _task(request: Request, body: Any, items: list[dict[str, Any]], allowed: set[str]
          ) -> tuple[ModelEntry, dict[str, Any]]:
    """The model's entry and the generate task's kwargs, checked (404 for an unknown LoRA,
    413 for too many or too long items) before anything is published."""
    entry, lora = openai_model(request, body, GENERATE)
    options = _options(body, allowed | {"lora"})
    if lora is not None:
        options["lora"] = lora
    kwargs = {"model": entry.id, "items": items, "options": options}
    check_items(request, entry.parse(kwargs))
    return entry, kwargs


async def _generate(request: Request, entry: ModelEntry, kwargs: dict[str, Any]) -> Reply:
    reply = await call_model(request, entry, kwargs)
    first = time_to_first_token_ms(reply.result)
    if first is not None:
        TIME_TO_FIRST_TOKEN.labels(entry.id, "false").observe(first / 1000)
        for latency in reply.result.get("latency") or ():
            INTER_TOKEN.labels(entry.id, "false").observe(latency["itl_ms"] / 1000)
    return reply


def _usage(result: dict[str, Any]) -> dict[str, int]:
    usage = result["usage"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }


async def _body(request: Request) -> dict[str, Any]:
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def _prompt_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        items = [{"text": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = [{"text": p} for p in prompt]
    else:
        # Token ids of the model's own vocabulary (one prompt, or one list per prompt), as
        # OpenAI's API takes them; anything else is refused there with what to send.
        items = openai_input_items(prompt, "prompt")
    return items


def completion_task(request: Request, body: dict[str, Any]
                    ) -> tuple[ModelEntry, dict[str, Any]]:
    """The entry and generate kwargs of a /v1/completions body that does not stream (an
    OpenAI batch line's body too: `gateway.routes.batch_endpoints`)."""
    return _task(request, body, _prompt_items(body), {"model", "prompt"})


def completion_payload(body: dict[str, Any], result: dict[str, Any],
                       completion_id: str) -> dict[str, Any]:
    """/v1/completions' response body for a body and its result."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body["model"],  # as the caller named it, "base:lora" included
        "choices": [{"index": c["index"], "text": c["text"], "logprobs": None,
                     "finish_reason": c["finish_reason"]} for c in result["choices"]],
        "usage": _usage(result),
    }


async def create_completion(request: Request) -> Response:
    body = await _body(request)
    return await _complete(request, body, _prompt_items(body), {"model", "prompt"},
                           _COMPLETION)


def _chat_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) for m in messages
    ):
        raise invalid("'messages' must be a non-empty list of {'role', 'content'}")
    # OpenAI's newer name for the system role.
    wire = [{"role": "system" if m.get("role") == "developer" else m.get("role"),
             "content": _message_text(m.get("content"), i)} for i, m in enumerate(messages)]
    return [{"messages": wire}]


def chat_task(request: Request, body: dict[str, Any]) -> tuple[ModelEntry, dict[str, Any]]:
    """The entry and generate kwargs of a /v1/chat/completions body that does not stream
    (an OpenAI batch line's body too)."""
    return _task(request, body, _chat_items(body), {"model", "messages"})


def chat_payload(body: dict[str, Any], result: dict[str, Any],
                 completion_id: str) -> dict[str, Any]:
    """/v1/chat/completions' response body for a body and its result."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body["model"],  # as the caller named it, "base:lora" included
        "choices": [{"index": 0, "message": {"role": "assistant", "content": c["text"]},
                     "logprobs": None, "finish_reason": c["finish_reason"]}
                    for c in result["choices"]],
        "usage": _usage(result),
    }


async def create_chat_completion(request: Request) -> Response:
    body = await _body(request)
    return await _complete(request, body, _chat_items(body), {"model", "messages"}, _CHAT)


@dataclass(frozen=True, slots=True)
class _Route:
    """What sets /v1/completions and /v1/chat/completions apart once their items are read."""

    id_prefix: str
    chunk_object: str  # a streamed chunk's `object`
    chat: bool
    payload: Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]]


_COMPLETION = _Route("cmpl", "text_completion", False, completion_payload)
_CHAT = _Route("chatcmpl", "chat.completion.chunk", True, chat_payload)


async def _complete(request: Request, body: dict[str, Any], items: list[dict[str, Any]],
                    allowed: set[str], route: _Route) -> Response:
    """Generate for a body's items: streamed, or answered whole in the route's shape."""
    stream, include_usage = _streaming(body)
    entry, kwargs = _task(request, body, items, allowed)
    completion_id = f"{route.id_prefix}-{uuid.uuid4().hex}"
    if stream:
        form = ChunkFormat(route.chunk_object, completion_id, body["model"], chat=route.chat,
                           include_usage=include_usage)
        return await stream_generation(request, entry, kwargs, form, len(items))
    reply = await _generate(request, entry, kwargs)
    return encode_response(request, route.payload(body, reply.result, completion_id),
                           headers=reply.headers)
