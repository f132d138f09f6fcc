"""Every error response of the gateway, in the shape its route's callers expect.

The OpenAI routes (`OPENAI_ROUTES`) answer in OpenAI's envelope and statuses, so that the
official SDKs and the frameworks over them raise their own exception classes (the openai
SDK raises `BadRequestError` for 400 only: shoal's native 422 would escape an
`except openai.BadRequestError`):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "input",
               "code": "VALIDATION_ERROR"}}

`code` keeps shoal's own code (OpenAI writes e.g. "model_not_found" there; a caller of
shoal branches on MODEL_NOT_FOUND on either route), `type` is OpenAI's (`openai_type`),
`param` the request field at fault or null (`openai_param`). Every other route keeps
shoal's `{"error": {"code": ..., "message": ...}}` and statuses (`ShoalError.body`).

Both carry `x-should-retry: true|false` (`ShoalError.retryable`): the OpenAI and Anthropic
SDKs obey it before their own rule (retry 408, 409, 429 and every 5xx, twice by default),
so a refusal that would fail the same way, or a deadline that passed while the request
may have run, is not sent two more times. Retry-After goes with it where known.

Whoever writes an error body (the routes' exception handlers, `gateway.routes.hot_path`,
the API-key middleware, the outer middleware) calls `error_response`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.edge.codecs import encode_response
from gateway.edge.compat_errors import bad_request_status
from tasks import tracing
from tasks.errors import ErrorCode, ShoalError

# The routes that speak OpenAI's API, each with the body field that carries its items
# (what `param` names for an error about an item, or about their number); None: no items.
# A route added to the OpenAI surface (e.g. /v1/rerank: "documents") is added here.
OPENAI_ROUTES: dict[str, str | None] = {
    "/v1/embeddings": "input",
    "/v1/completions": "prompt",
    "/v1/chat/completions": "messages",
    "/v1/models": None,
    "/v1/files": None,  # the Batch API's (gateway.routes.openai_files, openai_batches)
    "/v1/batches": None,
}
# Paths under these prefixes are OpenAI routes too (GET /v1/models/{id}).
OPENAI_PREFIXES: tuple[str, ...] = ("/v1/models/", "/v1/files/", "/v1/batches/")
# Routes that speak yet another API (e.g. TEI's /rerank), each with the function that
# gives an error's (status, body) in that API's shape: looked up before the rest.
ROUTE_SHAPES: dict[str, Callable[[ShoalError], tuple[int, Any]]] = {}

# Codes whose field is the model, whatever the message says.
_MODEL_CODES = frozenset({ErrorCode.MODEL_NOT_FOUND, ErrorCode.LORA_NOT_FOUND,
                          ErrorCode.FORBIDDEN, ErrorCode.UNSUPPORTED_OPERATION})
# shoal's messages about a field start by naming it: "'input' must be ...",
# "options.dimensions must be ...", "items[3].text must be ...", "input[1] is ...".
_LEADING_FIELD = re.compile(r"'(\w+)'|options\.(\w+)|(\w+)(?=\[)|(items)\b")


def is_openai_path(path: str) -> bool:
    return path in OPENAI_ROUTES or path.startswith(OPENAI_PREFIXES)


# The status OpenAI would answer: the rule Cohere's and Jina's APIs follow too (400 for a
# field's wrong value and for too many or too long inputs).
openai_status = bad_request_status


def openai_type(error: ShoalError, status: int) -> str:
    """OpenAI's `type`: what api.openai.com sends for the same status. A refusal of the
    API-key rate limits names the limit ("requests" or "tokens") in `openai_type`."""
    if status == 429:
        return getattr(error, "openai_type", None) or "requests"
    if status >= 500:
        return "server_error"
    # OpenAI sends invalid_request_error for 400, 401 (invalid_api_key), 403 and 404
    # (model_not_found) alike.
    return "invalid_request_error"


def openai_param(path: str, error: ShoalError) -> str | None:
    """The request field at fault in OpenAI's terms, or None. An item field (`items`,
    `items[3].text`) is the route's own (`input`, `prompt`, `messages`); an option is
    its name (`options.dimensions` is `dimensions`)."""
    param = error.param
    if param is None:
        if error.code in _MODEL_CODES:
            return "model"
        if error.status >= 500 or error.status == 429:
            return None
        found = _LEADING_FIELD.match(error.message)
        if found is None:
            return None
        param = next(group for group in found.groups() if group)
    if param == "items" or param.startswith("items["):
        return OPENAI_ROUTES.get(path) or param
    return param.removeprefix("options.")


def openai_body(path: str, error: ShoalError, status: int | None = None) -> dict[str, Any]:
    """OpenAI's error envelope for `error` on `path`, shoal's code in `code`."""
    status = openai_status(error) if status is None else status
    message = error.message
    field = OPENAI_ROUTES.get(path)
    if field is not None and message.startswith("items["):
        # The runtime's checks name the task's items ("items[2] has token id 99999 ..."):
        # on this route the caller sent them as `input` (or `prompt`, `messages`).
        message = field + message.removeprefix("items")
    return {"error": {"message": message, "type": openai_type(error, status),
                      "param": openai_param(path, error), "code": str(error.code)}}


def error_headers(error: ShoalError) -> dict[str, str]:
    """x-should-retry (both shapes) and, where known, Retry-After."""
    headers = {"x-should-retry": "true" if error.retryable else "false"}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return headers


def error_response(request: Request, error: ShoalError,
                   headers: dict[str, str] | None = None) -> Response:
    """The error response for `error` on the request's route (JSON or msgpack as the
    caller accepts), with `headers` added."""
    path = request.scope["path"]
    if tracing.ENABLED:  # the code on the request's server span
        tracing.set_attribute("shoal.error_code", str(error.code))
    out = error_headers(error)
    if headers:
        out.update(headers)
    shape = ROUTE_SHAPES.get(path)
    if shape is not None:
        status, body = shape(error)
        return encode_response(request, body, status, out)
    if is_openai_path(path):
        status = openai_status(error)
        return encode_response(request, openai_body(path, error, status), status, out)
    return encode_response(request, error.body(), error.status, out)
