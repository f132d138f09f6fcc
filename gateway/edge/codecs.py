"""Request bodies and responses in JSON or msgpack.

The request's `Content-Type` picks the decoder; the response follows
`Accept`, defaulting to the request's own type.
"""

from __future__ import annotations

from typing import Any

import msgpack
import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.edge.api_errors import ApiError
from gateway.edge.raw_headers import header
from tasks.errors import ErrorCode

JSON = "application/json"
MSGPACK = "application/msgpack"
_MSGPACK_TYPES = {"application/msgpack", "application/x-msgpack"}


def media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def is_msgpack(header: str | None) -> bool:
    return media_type(header) in _MSGPACK_TYPES


async def read_body(request: Request, max_bytes: int) -> Any:
    """The decoded body; 413 if over `max_bytes`, 400 if it does not parse."""
    check_declared_size(request, max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    # Peak memory: the body twice while it is decoded (`raw` and what msgpack or orjson
    # make of it), once after: `raw` goes when this returns, the pieces go now.
    chunks.clear()
    return decode_body(request, raw)


def check_declared_size(request: Request, max_bytes: int) -> None:
    """413 before any of the body is read when its Content-Length is over `max_bytes`."""
    declared = header(request, b"content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)


def decode_body(request: Request, raw: bytes) -> Any:
    """A whole body (read within its limit) decoded by its Content-Type; 400 if it does
    not parse, 415 for a type that is neither JSON nor msgpack. The HTTP edge's hot path
    (`gateway.edge.hot_requests`) reads the body itself and calls this."""
    request.state.body_bytes = len(raw)  # for a limit that depends on what the body names
    kind = media_type(header(request, b"content-type"))
    if kind in _MSGPACK_TYPES:
        try:
            return msgpack.unpackb(raw, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ApiError(ErrorCode.INVALID_REQUEST, f"body is not valid msgpack: {exc}") from None
    if kind not in ("", JSON) and not kind.endswith("+json"):
        raise ApiError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"Content-Type {kind!r} is not supported; send application/json or "
            "application/msgpack",
        )
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, _not_json(raw, exc)) from None


def _not_json(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """Why a body is not JSON, in the caller's terms: orjson reports any byte that is not
    UTF-8 as "surrogates not allowed ... (char 0)", wherever it is."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return (f"body is not UTF-8 text: the byte at offset {bad.start} "
                f"(0x{raw[bad.start]:02x}) is not valid UTF-8; JSON must be sent as UTF-8 "
                "(send text in another encoding converted, or binary as application/msgpack)")
    return f"body is not valid JSON: {exc}"


def check_body_size(request: Request, max_bytes: int) -> None:
    """413 if the body `read_body` read (under a wider limit) is over `max_bytes`."""
    if getattr(request.state, "body_bytes", 0) > max_bytes:
        raise too_large(max_bytes)


def too_large(max_bytes: int) -> ApiError:
    return ApiError(ErrorCode.PAYLOAD_TOO_LARGE, f"body is over the {max_bytes}-byte limit")


def wants_msgpack(request: Request) -> bool:
    accept = header(request, b"accept") or ""
    for part in accept.split(","):
        kind = media_type(part)
        if kind in _MSGPACK_TYPES:
            return True
        if kind == JSON:
            return False
    return is_msgpack(header(request, b"content-type"))


def encode_response(
    request: Request | None, payload: Any, status: int = 200, headers: dict | None = None
) -> Response:
    body, kind = encode_payload(request, payload)
    return Response(body, status, headers, media_type=kind)


def encode_payload(request: Request | None, payload: Any) -> tuple[bytes, str]:
    """A response body as the caller accepts it, and its media type (the hot path writes
    these bytes itself, without a Response)."""
    if request is not None and wants_msgpack(request):
        return msgpack.packb(payload, use_bin_type=True, default=_as_list), MSGPACK
    # orjson: serialising 384 floats costs 0.02 ms instead of json's 0.3 ms; a numpy
    # array (`gateway.calls.vectors`) is written without a list of floats in between.
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), JSON


def _as_list(value: Any) -> Any:
    """msgpack's fallback: a numpy array as (nested) lists of numbers."""
    to_list = getattr(value, "tolist", None)
    if to_list is None:
        raise TypeError(f"cannot serialise {type(value).__name__}")
    return to_list()
