"""The one error type of shoal: codes, their HTTP status, and how a failure travels.

A whole-request failure travels as a Celery FAILURE whose exception is a
`ShoalError(code, message)`, serialised without pickle the way Celery does it
(`as_celery_failure`); a Celery client's `AsyncResult.get()` raises it again
(the class is found through `exc_module`), and a gateway reads it back with
`ShoalError.from_celery_failure`. The gateway answers any ShoalError with `status`, as
`{"error": {"code": ..., "message": ...}}` on the native routes and in OpenAI's envelope
on the OpenAI routes (`gateway.edge.error_shapes`).

Whether sending the same request again can help is `ShoalError.retryable` (the gateway's
`x-should-retry` header, which the OpenAI and Anthropic SDKs obey): `RETRY_HELPS` lists
the codes where it can, and a DEADLINE_EXCEEDED is retryable only when the request is known
not to have started (`started is False`): one that ran, or may have, would run again.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    INVALID_REQUEST = "INVALID_REQUEST"  # body is not valid JSON/msgpack
    VALIDATION_ERROR = "VALIDATION_ERROR"  # a field has the wrong type or value
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    LORA_NOT_FOUND = "LORA_NOT_FOUND"  # the model has no LoRA adapter of that name
    # The model could not be loaded (bad weights, does not fit the device even after
    # evicting every model that may go), or no worker serves it: retry later or elsewhere.
    MODEL_UNAVAILABLE = "MODEL_UNAVAILABLE"
    NOT_FOUND = "NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"  # body bytes or item count over the limit
    INPUT_TOO_LONG = "INPUT_TOO_LONG"  # a text over the model's length with truncate=false
    QUEUE_FULL = "QUEUE_FULL"
    BROKER_UNAVAILABLE = "BROKER_UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    # The request alone is predicted (from measured batches of its shape, or the model's
    # tuned profile) to take longer than its whole deadline: sent again with the same
    # deadline it would be refused again, so the status is one clients do not retry.
    DEADLINE_TOO_SHORT = "DEADLINE_TOO_SHORT"
    UNSUPPORTED_OPERATION = "UNSUPPORTED_OPERATION"
    INTERNAL = "INTERNAL"
    # This request, run alone, crashed the model runtime or made inference fail;
    # not retried (it would fail again), every other request of its batch was served.
    POISON_INPUT = "POISON_INPUT"
    # The runtime or worker failed after part of a streamed output went out: that part
    # stands, the rest will not come (a rerun would repeat it); retry the request.
    STREAM_INTERRUPTED = "STREAM_INTERRUPTED"
    # Its caller revoked it (a Celery revoke, or an HTTP client that left a stream).
    CANCELLED = "CANCELLED"
    # A claim-checked binary (see tasks.blobs) that is not in the blob store, or whose
    # bytes do not match the claim's size and sha256: that request fails alone.
    BLOB_MISSING = "BLOB_MISSING"
    BLOB_CORRUPT = "BLOB_CORRUPT"
    BLOB_STORE_UNAVAILABLE = "BLOB_STORE_UNAVAILABLE"
    JOB_NOT_FOUND = "JOB_NOT_FOUND"
    JOB_NOT_FINISHED = "JOB_NOT_FINISHED"  # its result was asked for before it succeeded
    JOB_STORE_UNAVAILABLE = "JOB_STORE_UNAVAILABLE"  # Redis (SHOAL_REDIS_URL) not reachable
    # A key's jobs at once or their queued texts over SHOAL_JOBS_PER_KEY/_JOB_TEXTS_PER_KEY
    TOO_MANY_JOBS = "TOO_MANY_JOBS"
    # API keys (gateway.auth): no key or a wrong one; a key not allowed this model;
    # a key over its requests or tokens per minute.
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    RATE_LIMITED = "RATE_LIMITED"
    HEADERS_TOO_LARGE = "HEADERS_TOO_LARGE"  # request headers over the gateway's limit
    # The gateway is draining (SIGTERM): it answers what is in flight, takes nothing new.
    SHUTTING_DOWN = "SHUTTING_DOWN"
    # The HTTP edge (gateway.edge): headers or body not received within their read timeout;
    # the gateway holds SHOAL_GATEWAY_MAX_CONNECTIONS connections and refuses more.
    REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
    TOO_MANY_CONNECTIONS = "TOO_MANY_CONNECTIONS"


STATUS_OF_CODE: dict[str, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.LORA_NOT_FOUND: 404,
    ErrorCode.MODEL_UNAVAILABLE: 503,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.INPUT_TOO_LONG: 413,
    ErrorCode.UNSUPPORTED_OPERATION: 422,
    # The input crashed or broke the model every time it ran: retrying won't help.
    ErrorCode.POISON_INPUT: 422,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.BROKER_UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.DEADLINE_TOO_SHORT: 422,
    ErrorCode.INTERNAL: 500,
    ErrorCode.STREAM_INTERRUPTED: 503,
    # nginx's "client closed request": nobody is left to read it.
    ErrorCode.CANCELLED: 499,
    # The store lost it (deleted, expired) or it was altered: send the request again.
    ErrorCode.BLOB_MISSING: 422,
    ErrorCode.BLOB_CORRUPT: 422,
    ErrorCode.BLOB_STORE_UNAVAILABLE: 503,
    ErrorCode.JOB_NOT_FOUND: 404,
    ErrorCode.JOB_NOT_FINISHED: 409,
    ErrorCode.JOB_STORE_UNAVAILABLE: 503,
    ErrorCode.TOO_MANY_JOBS: 429,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.HEADERS_TOO_LARGE: 431,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.TOO_MANY_CONNECTIONS: 503,
}

# The codes where the same request, sent again (after Retry-After, if given), may succeed:
# the fleet, the broker or a store was away or full, or the caller was slow. Every other
# refusal would be refused again (a wrong field, a deadline too short for the request, a
# poison input) or repeat work that ran: INTERNAL is a fault no retry is known to mend
# (an unexpected exception with this input, or a worker's), so it is not retried either.
# DEADLINE_EXCEEDED depends on `started` (see `ShoalError.retryable`).
RETRY_HELPS: frozenset[str] = frozenset({
    ErrorCode.MODEL_UNAVAILABLE, ErrorCode.QUEUE_FULL, ErrorCode.RATE_LIMITED,
    ErrorCode.BROKER_UNAVAILABLE, ErrorCode.SHUTTING_DOWN, ErrorCode.TOO_MANY_CONNECTIONS,
    ErrorCode.STREAM_INTERRUPTED, ErrorCode.BLOB_MISSING, ErrorCode.BLOB_CORRUPT,
    ErrorCode.BLOB_STORE_UNAVAILABLE, ErrorCode.JOB_STORE_UNAVAILABLE,
    ErrorCode.JOB_NOT_FINISHED, ErrorCode.REQUEST_TIMEOUT, ErrorCode.TOO_MANY_JOBS,
})


class ShoalError(Exception):
    """A request that cannot be served, with a code callers can branch on.

    Its args are exactly (code, message): that is what Celery serialises and
    what a client rebuilds it from. `status` and `retry_after` are the HTTP side;
    `param` names the request field at fault where it is known (OpenAI's `param`: it
    stays on the gateway); `started` says whether the work began running (None: not
    known), which decides whether a DEADLINE_EXCEEDED may be retried. `retry_after` and
    `started` travel beside Celery's own keys of a failure (`as_celery_failure`).
    """

    def __init__(self, code: str, message: str, retry_after: int | None = None, *,
                 param: str | None = None, started: bool | None = None) -> None:
        super().__init__(code, message)
        self.code = ErrorCode(code) if code in ErrorCode.__members__ else code
        self.message = message
        self.status = STATUS_OF_CODE.get(code, 500)
        self.retry_after = retry_after
        self.param = param
        self.started = started

    @property
    def retryable(self) -> bool:
        """Whether the same request, sent again, may succeed (see `RETRY_HELPS`). A
        DEADLINE_EXCEEDED is, only when it is known not to have started: one that ran (or
        may have, as when the gateway stopped waiting) would run again, and fail again."""
        if self.code == ErrorCode.DEADLINE_EXCEEDED:
            return self.started is False
        return self.code in RETRY_HELPS

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def body(self) -> dict[str, Any]:
        """The HTTP error body."""
        return {"error": {"code": str(self.code), "message": self.message}}

    def as_celery_failure(self) -> dict[str, Any]:
        """The `result` of a Celery FAILURE carrying this error, as Celery writes an
        exception without pickle: a client finds the class through `exc_module`. A
        Retry-After and whether it started travel beside them (Celery reads only those
        three keys)."""
        failure: dict[str, Any] = {"exc_type": ShoalError.__name__,
                                   "exc_message": [str(self.code), self.message],
                                   "exc_module": __name__}
        if self.retry_after is not None:
            failure["retry_after"] = self.retry_after
        if self.started is not None:
            failure["started"] = self.started
        return failure

    @classmethod
    def from_celery_failure(cls, meta: Any) -> ShoalError:
        """The error a Celery FAILURE result carries; any other exception a worker
        reported becomes INTERNAL."""
        if isinstance(meta, dict):
            args = meta.get("exc_message")
            if meta.get("exc_type") == ShoalError.__name__ and isinstance(args, list | tuple) \
                    and len(args) == 2:
                retry_after = meta.get("retry_after")
                started = meta.get("started")
                return cls(str(args[0]), str(args[1]),
                           retry_after if isinstance(retry_after, int) else None,
                           started=started if isinstance(started, bool) else None)
            return cls(ErrorCode.INTERNAL, f"worker error {meta.get('exc_type')}: {args}")
        return cls(ErrorCode.INTERNAL, f"worker error: {meta!r}")


def invalid(message: str, param: str | None = None) -> ShoalError:
    """A request that is wrong in a way its message tells the caller how to fix; `param`:
    the field at fault, where the message does not start by naming it."""
    return ShoalError(ErrorCode.VALIDATION_ERROR, message, param=param)
