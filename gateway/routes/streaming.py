"""Streamed generation as OpenAI's server-sent events.

The request goes out with `stream: true`; the worker publishes its output as
Celery PROGRESS states (`{"choices": [{"index", "text", "tokens"}]}`) and then
its result, which `gateway.broker.streams.ReplyStreams.stream` hands over in order. The
response starts only once the first of them is in, so an error the worker
finds before generating (a prompt over the context: 413) is an HTTP status,
not an event. After that, an error (a runtime that died mid-stream, the
deadline) is one `data: {"error": ...}` event, which the `openai` client
raises as an APIError; the stream never just stops. A client that disconnects
cancels the task iterating, which revokes the request (the worker stops
generating at its next token).

Chunks follow OpenAI's: `chat.completion.chunk` (the first carries the
assistant role) or `text_completion`; a last chunk per choice carries its
finish_reason, and with `stream_options.include_usage` every chunk has
`usage: null` and one more, with no choices, has the usage. Then `[DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import StreamingResponse

from gateway.calls.model_call import timeout_ms
from gateway.edge.error_shapes import openai_body
from gateway.edge.gateway_metrics import INTER_TOKEN, TIME_TO_FIRST_TOKEN
from tasks.catalog import ModelEntry
from tasks.envelope import PROGRESS, SUCCESS, task_part
from tasks.errors import ShoalError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ChunkFormat:
    """How one OpenAI endpoint shapes its chunks."""

    def __init__(self, object_name: str, completion_id: str, model: str, chat: bool,
                 include_usage: bool) -> None:
        self.object_name = object_name
        self.id = completion_id
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.created = int(time.time())

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              last: bool = False) -> bytes:
        payload: dict[str, Any] = {"id": self.id, "object": self.object_name,
                                   "created": self.created, "model": self.model,
                                   "choices": choices}
        if self.include_usage:
            payload["usage"] = usage if last else None
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def choice(self, index: int, text: str | None, finish_reason: str | None = None,
               role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": None,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": None,
                "finish_reason": finish_reason}


async def stream_generation(request: Request, entry: ModelEntry, kwargs: dict[str, Any],
                            form: ChunkFormat, choices: int) -> StreamingResponse:
    """Publish a streamed generate request and answer with its events (see the module)."""
    started = time.perf_counter()
    budget_ms = timeout_ms(request)
    events = request.app.state.broker.stream(
        entry.id, task_part(entry, {**kwargs, "stream": True}, budget_ms), budget_ms / 1000)
    first = await anext(events)  # ApiError (deadline, broker) is an HTTP error
    if first.get("status") not in (PROGRESS, SUCCESS):
        await events.aclose()
        raise ShoalError.from_celery_failure(first.get("result"))
    return StreamingResponse(_events(first, events, form, choices, entry.id, started),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _events(first: dict[str, Any], events: AsyncIterator[dict[str, Any]],
                  form: ChunkFormat, choices: int, model: str,
                  started: float) -> AsyncIterator[bytes]:
    timing = _Timing(model, started)
    try:
        if form.chat:
            yield form.chunk([form.choice(i, "", role=True) for i in range(choices)])
        event: dict[str, Any] | None = first
        while event is not None:
            status = event.get("status")
            if status == PROGRESS:
                made = (event.get("result") or {}).get("choices") or []
                if made:
                    timing.chunk(made)
                    yield form.chunk([form.choice(int(c["index"]), str(c["text"]))
                                      for c in made])
            elif status == SUCCESS:
                for chunk in _ending(form, event["result"]):
                    yield chunk
                return
            else:
                yield _error(form, ShoalError.from_celery_failure(event.get("result")))
                return
            event = await anext(events, None)
        yield _error(form, ShoalError("INTERNAL", "the stream ended without a result"))
    except ShoalError as exc:  # the deadline passed mid-stream
        yield _error(form, exc)
    finally:
        await events.aclose()  # revokes the request unless its result came


def _ending(form: ChunkFormat, result: dict[str, Any]) -> list[bytes]:
    chunks = [form.chunk([form.choice(int(c["index"]), None if form.chat else "",
                                      c["finish_reason"])]) for c in result["choices"]]
    if form.include_usage:
        usage = result["usage"]
        chunks.append(form.chunk([], {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        }, last=True))
    chunks.append(b"data: [DONE]\n\n")
    return chunks


def _error(form: ChunkFormat, exc: ShoalError) -> bytes:
    """The error event, in OpenAI's envelope as the route's error responses are."""
    path = "/v1/chat/completions" if form.chat else "/v1/completions"
    return b"data: " + orjson.dumps(openai_body(path, exc)) + b"\n\n"


class _Timing:
    """Time to first token and between tokens, as the client sees them (metrics)."""

    def __init__(self, model: str, started: float) -> None:
        self.model = model
        self.started = started
        self.last: float | None = None
        self.tokens: dict[int, int] = {}

    def chunk(self, made: list[dict[str, Any]]) -> None:
        now = time.perf_counter()
        new = 0
        for choice in made:
            index, tokens = int(choice["index"]), int(choice.get("tokens") or 0)
            new += max(0, tokens - self.tokens.get(index, 0))
            self.tokens[index] = tokens
        if self.last is None:
            TIME_TO_FIRST_TOKEN.labels(self.model, "true").observe(now - self.started)
        elif new:
            gap = (now - self.last) / new
            for _ in range(min(new, 64)):
                INTER_TOKEN.labels(self.model, "true").observe(gap)
        self.last = now
