"""The API-key middleware (`gateway.auth.access` installs it when keys are configured): finds
the caller's key, answers 401 or 429 itself, filters /v1/models, and leaves the key in
the request's scope state for `gateway.auth.access.check_model_allowed`."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import msgpack
import orjson
from starlette.requests import Request

from gateway.auth.access import AUTH_REFUSALS, STATE_KEY
from gateway.auth.key_file import ApiKey, KeyFileError, KeyRing, load_key_ring
from gateway.auth.rate_limit import TOKENS, RateLimiter, retry_after_header
from gateway.edge.api_errors import ApiError
from gateway.edge.codecs import is_msgpack
from gateway.edge.error_shapes import error_response
from tasks.errors import ErrorCode
from tasks.token_estimate import CHARS_PER_TOKEN

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
MODELS_PATH = "/v1/models"


class KeySource:
    """The keys file, read again when it changes (checked every `reload_s` at most), so
    keys are added, rotated and revoked without a restart. A changed file that cannot be
    used is logged and the keys read before stay in force."""

    def __init__(self, path: Path, reload_s: float) -> None:
        self.path = path
        self.reload_s = reload_s
        self._stamp = self._stat()
        self.ring: KeyRing = load_key_ring(path)
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()  # follows a Kubernetes Secret's symlink swap
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def current(self) -> KeyRing:
        now = time.monotonic()
        if now - self._checked >= self.reload_s:
            self._checked = now
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self.ring = load_key_ring(self.path)
                    log.warning("API keys: read %d keys from %s", len(self.ring.keys),
                                self.path)
                except KeyFileError as exc:
                    log.error("API keys: keeping the %d keys read before: %s",
                              len(self.ring.keys), exc)
        return self.ring


def bearer_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                return key.strip()
            return None
    return None


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class ApiKeyMiddleware:
    """Finds the caller's key, refuses (401, 429) or passes the request on with the key in
    its scope state (for `check_model_allowed`)."""

    def __init__(self, app: Any, source: KeySource, limiter: RateLimiter) -> None:
        self.app = app
        self.source = source
        self.limiter = limiter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            if scope["type"] == "lifespan":
                receive = self._closing_on_shutdown(receive)
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        presented = bearer_key(headers)
        key = self.source.current().find(presented) if presented is not None else None
        if key is None:
            # RFC 6750: the challenge names the error only when a key was sent.
            error, challenge = (
                (ApiError(ErrorCode.UNAUTHORIZED, "the API key is not valid"),
                 'Bearer realm="shoal", error="invalid_token"') if presented is not None else
                (ApiError(ErrorCode.UNAUTHORIZED, "an API key is required: send "
                          "'Authorization: Bearer <key>'"), 'Bearer realm="shoal"'))
            AUTH_REFUSALS.labels("invalid_key" if presented is not None else "missing_key").inc()
            await self._refuse(scope, send, error, {"WWW-Authenticate": challenge})
            return
        scope.setdefault("state", {})[STATE_KEY] = key
        declared = _content_length(headers)
        verdict = await self.limiter.admit(key, -(-(declared or 0) // CHARS_PER_TOKEN))
        if not verdict.admitted:
            AUTH_REFUSALS.labels(f"{verdict.limit}_per_minute").inc()
            per = (f"{key.tokens_per_minute} tokens" if verdict.limit == TOKENS
                   else f"{key.requests_per_minute} requests")
            refusal = ApiError(
                ErrorCode.RATE_LIMITED, f"the API key {key.name!r} is over its limit of {per} "
                "per minute; retry after the time Retry-After gives",
                retry_after=retry_after_header(verdict.retry_after_s))
            # OpenAI's `type` of a rate-limit error names the limit (gateway.edge.error_shapes)
            refusal.openai_type = "tokens" if verdict.limit == TOKENS else "requests"
            await self._refuse(scope, send, refusal)
            return
        if scope["path"] == MODELS_PATH and scope["method"] == "GET":
            send = _models_filter(scope, send, key)
        if declared is None and key.tokens_per_minute is not None:
            await self._counting_body(scope, receive, send, key)
            return
        await self.app(scope, receive, send)

    async def _counting_body(self, scope: dict, receive: Any, send: Any, key: ApiKey) -> None:
        """A body without Content-Length (chunked): its tokens are charged once it is read."""
        size = 0

        async def counting_receive() -> dict:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            await self.limiter.charge(key, -(-size // CHARS_PER_TOKEN))

    def _closing_on_shutdown(self, receive: Any) -> Any:
        async def wrapped() -> dict:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.limiter.close()
            return message

        return wrapped

    @staticmethod
    async def _refuse(scope: dict, send: Any, error: ApiError,
                      headers: dict[str, str] | None = None) -> None:
        """The route's error body (JSON or msgpack as the caller accepts), written here:
        this runs outside the app's exception handlers."""
        response = error_response(Request(scope), error, headers)
        await response(scope, _drain_nothing, send)


async def _drain_nothing() -> dict:
    return {"type": "http.disconnect"}


def _models_filter(scope: dict, send: Any, key: ApiKey) -> Any:
    """`send` for GET /v1/models that drops the models `key` may not use from the list (a
    LoRA entry goes with its base model)."""
    start: dict | None = None
    chunks: list[bytes] = []

    async def filtering_send(message: dict) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body" or start is None:
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        headers = start.get("headers", [])
        body = b"".join(chunks)
        if start["status"] == 200:
            body = _filtered_models(body, headers, key)
            headers = [(n, v) for n, v in headers if n != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return filtering_send


def _filtered_models(body: bytes, headers: list[tuple[bytes, bytes]], key: ApiKey) -> bytes:
    content_type = next((v.decode("latin-1") for n, v in headers if n == b"content-type"), "")
    packed = is_msgpack(content_type)
    listing = msgpack.unpackb(body, raw=False) if packed else orjson.loads(body)
    listing["data"] = [m for m in listing.get("data", [])
                       if key.allows(m.get("parent") or m.get("id", ""))]
    return msgpack.packb(listing, use_bin_type=True) if packed else orjson.dumps(listing)
