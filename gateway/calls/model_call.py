"""Turn a validated request into a task message, publish it and await its result."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from starlette.requests import Request

from gateway.auth.access import check_model_allowed, models_visible
from gateway.calls.blob_offload import check_out, has_claims, submit_claimed
from gateway.calls.request_trace import TRACE_HEADER, hop_trace
from gateway.calls.work_deadline import default_budget_ms
from gateway.edge.api_errors import ApiError, invalid
from gateway.edge.raw_headers import header, header_values
from gateway.edge.tracing import call_span, reply_span
from tasks import tracing
from tasks.catalog import ModelEntry
from tasks.envelope import SUCCESS, task_part
from tasks.errors import ErrorCode, ShoalError
from tasks.render import shown
from tasks.schema import ParsedRequest
from tasks.served import read_served, reply_headers
from tasks.token_estimate import CHARS_PER_TOKEN


@dataclass(slots=True)
class Reply:
    result: dict[str, Any]
    headers: dict[str, str]


# int() would take "+100", "1_000", " 100 " or Unicode digits: a deadline is plain ASCII
# digits, so that every proxy and client in front reads the header as the gateway does.
_MAX_TIMEOUT_DIGITS = 18  # longer is out of range anyway; int() is not fed unbounded text


def timeout_ms(request: Request) -> int:
    """The request's X-Timeout-Ms, or SHOAL_DEFAULT_TIMEOUT_MS."""
    sent = sent_timeout_ms(request)
    return request.app.state.settings.default_timeout_ms if sent is None else sent


def sent_timeout_ms(request: Request) -> int | None:
    """The request's X-Timeout-Ms, checked; None when it sent none."""
    settings = request.app.state.settings
    values = header_values(request, b"x-timeout-ms")
    if not values:
        return None
    if len(values) > 1:
        # Which one would win depends on the server and any proxy: refuse rather than guess.
        raise invalid(f"X-Timeout-Ms was sent {len(values)} times; send it once")
    # The value as the server hands it over, stripped of nothing more: the spaces and tabs
    # HTTP allows around a value (RFC 9110 5.5) are already gone (llhttp, uvicorn).
    raw = values[0]
    if not (raw.isascii() and raw.isdigit()):
        raise invalid(f"X-Timeout-Ms must be a whole number of milliseconds in plain "
                      f"digits (e.g. 5000), got {shown(raw)}")
    if len(raw) > _MAX_TIMEOUT_DIGITS or not 1 <= int(raw) <= settings.max_timeout_ms:
        raise invalid(f"X-Timeout-Ms must be between 1 and {settings.max_timeout_ms}")
    return int(raw)


ROUTE_OF_OPERATION = {
    "encode": "POST /v1/encode/{model} or /v1/embeddings",
    "score": "POST /v1/score/{model}",
    "extract": "POST /v1/extract/{model}",
    "classify": "POST /v1/classify/{model}",
    "generate": "POST /v1/completions or /v1/chat/completions",
}


def served_model(request: Request, model: Any, op: str) -> ModelEntry:
    """The entry of a served model that performs `op`; 404 or 422 otherwise."""
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string")
    check_model_allowed(request, model)  # 403 before anything says whether it exists
    entry = request.app.state.served.get(model)
    if entry is None:
        why = ("is in the catalog but not among this gateway's SHOAL_GATEWAY_MODELS"
               if request.app.state.catalog.get(model) is not None else "is not served here")
        accepted = models_visible(request, sorted(request.app.state.served))
        raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"model {shown(model)} {why}; "
                       f"{served_listing(request, accepted)}")
    if entry.operation != op:
        raise ApiError(ErrorCode.UNSUPPORTED_OPERATION,
                       f"{model} does not {op}: it serves '{entry.operation}' "
                       f"({ROUTE_OF_OPERATION[entry.operation]})")
    return entry


def served_now(request: Request, models: list[str]) -> list[str]:
    """Those of `models` that a worker serves now (its latest pool state says so)."""
    pool, now = request.app.state.broker.pool, time.monotonic()
    return [model for model in models if pool.serves(model, now)]


def served_listing(request: Request, accepted: list[str], what: str = "models") -> str:
    """What an unknown model's 404 lists: of the `accepted` models (those the caller's
    key may use), the ones workers serve now, not every catalog entry the gateway would
    accept (33 with the default SHOAL_GATEWAY_MODELS), and where all are listed."""
    return (f"{what} served now: {served_now(request, accepted)} (GET /v1/models; "
            f"/v1/models?all=true lists all {len(accepted)} this gateway accepts)")


def check_items(request: Request, parsed: ParsedRequest) -> None:
    """413 for more items, or longer texts (or token-id lists), than this gateway accepts."""
    settings = request.app.state.settings
    if len(parsed.items) > settings.max_items:
        # param: on the OpenAI routes a 400 naming the items' field, as OpenAI answers
        raise ApiError(ErrorCode.PAYLOAD_TOO_LARGE, f"{len(parsed.items)} items is over the "
                       f"limit of {settings.max_items} per request (SHOAL_MAX_ITEMS); send "
                       "them in several requests", param="items")
    for i, item in enumerate(parsed.items):
        if item.tokens is not None:
            _check_token_count(i, len(item.tokens), settings.max_text_chars)
            continue
        chars = len(item.text) if item.text is not None else sum(
            len(content) for _, content in item.messages or ())
        if chars > settings.max_text_chars:
            raise ApiError(ErrorCode.PAYLOAD_TOO_LARGE,
                           f"item {i} has {chars} characters, over the limit of "
                           f"{settings.max_text_chars}", param=f"items[{i}]")


def _check_token_count(index: int, count: int, max_text_chars: int) -> None:
    """A token-id item may be as long as the longest text's tokens (SHOAL_MAX_TEXT_CHARS at
    the estimate's characters per token), not the model's length limit: a longer one is
    truncated where it runs, as a text is (or refused there with options.truncate false)."""
    limit = max(1, max_text_chars // CHARS_PER_TOKEN)
    if count > limit:
        raise ApiError(ErrorCode.PAYLOAD_TOO_LARGE,
                       f"item {index} has {count} token ids, over the limit of {limit} "
                       f"(SHOAL_MAX_TEXT_CHARS / {CHARS_PER_TOKEN})", param=f"items[{index}]")


def wire_items(parsed: ParsedRequest) -> list[dict[str, Any]]:
    """Items as they travel: images as raw bytes (msgpack bin), never base64; `call_model`
    turns those over SHOAL_CLAIM_CHECK_BYTES into claim checks."""
    out: list[dict[str, Any]] = []
    for item in parsed.items:
        if item.image is not None:
            out.append({"image": item.image})
        elif item.messages is not None:
            out.append({"messages": [{"role": r, "content": c} for r, c in item.messages]})
        elif item.tokens is not None:
            out.append({"tokens": list(item.tokens)})
        else:
            out.append({"text": item.text})
    return out


async def call_model(request: Request, entry: ModelEntry, kwargs: dict[str, Any]) -> Reply:
    """Publish the entry's operation with `kwargs` (already checked) and await the result."""
    started = time.perf_counter()
    sent_timeout_ms(request)  # a bad X-Timeout-Ms is refused before any upload
    broker = request.app.state.broker
    settings = request.app.state.settings
    # Images over SHOAL_CLAIM_CHECK_BYTES travel as claims; their bytes go to the blob
    # store while the message is already queued (gateway.calls.blob_offload).
    kwargs, uploads = await check_out(kwargs, settings.claim_check_bytes)
    call = prepare_call(request, entry, kwargs, len(uploads), started)
    if uploads:
        reply = await submit_claimed(broker, entry.id, call.part, call.budget_ms / 1000,
                                     uploads, settings.blob_url,
                                     settings.claim_upload_timeout_s, request.scope)
    else:
        # With the request's scope: a caller that hangs up releases its request.
        reply = await broker.submit(entry.id, call.part, call.budget_ms / 1000, request.scope)
    return finish_call(request, call, reply)


@dataclass(slots=True)
class Call:
    """A request's task part as it is published, its deadline and when its call began."""

    part: Any
    budget_ms: int
    started: float


def prepare_call(request: Request, entry: ModelEntry, kwargs: dict[str, Any], claims: int = 0,
                 started: float | None = None) -> Call:
    """The task part of `kwargs` (checked, claims already checked out) with its deadline:
    X-Timeout-Ms, else the default (as long as a large request's work: see the module)."""
    started = time.perf_counter() if started is None else started
    sent_ms = sent_timeout_ms(request)
    settings = request.app.state.settings
    budget_ms = settings.default_timeout_ms if sent_ms is None else sent_ms
    part = task_part(entry, kwargs, budget_ms, claims=claims)
    if sent_ms is None:
        work_ms = default_budget_ms(entry, part.annotations, settings)
        if work_ms != budget_ms:
            budget_ms = work_ms
            part = replace(part, annotations=replace(
                part.annotations, deadline_ms=int(part.annotations.sent_ms or 0) + work_ms))
    if tracing.ENABLED:
        call_span(part)
    return Call(part, budget_ms, started)


def start_call(request: Request, entry: ModelEntry, kwargs: dict[str, Any]
               ) -> tuple[Awaitable[Any], Callable[[Any], Reply]]:
    """The HTTP edge's hot path (`gateway.edge.hot_requests`): the call's awaitable (the
    broker's wait for the reply; `call_model` whole for a request with claims to upload)
    and what turns what it gives into the Reply. Checks and builds the part now."""
    if has_claims(kwargs, request.app.state.settings.claim_check_bytes):
        return call_model(request, entry, kwargs), reply_as_is
    call = prepare_call(request, entry, kwargs)
    waiting = request.app.state.broker.submit(entry.id, call.part, call.budget_ms / 1000,
                                              request.scope)
    return waiting, partial(finish_call, request, call)


def reply_as_is(reply: Reply) -> Reply:
    """The `finish` of an awaitable that already gives the Reply (`call_model`)."""
    return reply


def finish_call(request: Request, call: Call, reply: dict[str, Any]) -> Reply:
    """The broker's reply as the result and its response headers; the failure it carries
    raised as the ShoalError it names."""
    replied = time.time()
    if reply.get("status") != SUCCESS:
        raise ShoalError.from_celery_failure(reply.get("result"))
    result = reply["result"]
    if tracing.ENABLED:
        reply_span(read_served(result).timing, replied)
    out_headers = {"X-Total-Time-Ms": f"{(time.perf_counter() - call.started) * 1000:.1f}",
                   **reply_headers(result)}
    if header(request, TRACE_HEADER.encode()) is not None:
        # The outer middleware stamped its arrival (`gateway.calls.request_trace`).
        arrived = getattr(request.state, "arrived", replied)
        out_headers["X-Shoal-Trace"] = hop_trace(arrived, call.part.annotations.sent_ms,
                                                 read_served(result).timing, replied,
                                                 time.time())
    return Reply(result, out_headers)
