"""Machine-readable error codes shared by workers, gateways and Celery clients.

A whole-request failure travels as a Celery FAILURE whose exception is a
`ShoalError(code, message)`; a Celery client's `AsyncResult.get()` raises it
again (the class is found through `exc_module`).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_REQUEST = "INVALID_REQUEST"  # body is not valid JSON/msgpack
    VALIDATION_ERROR = "VALIDATION_ERROR"  # a field has the wrong type or value
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    NOT_FOUND = "NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"  # body bytes or item count over the limit
    INPUT_TOO_LONG = "INPUT_TOO_LONG"  # a text over the model's length with truncate=false
    QUEUE_FULL = "QUEUE_FULL"
    BROKER_UNAVAILABLE = "BROKER_UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNSUPPORTED_OPERATION = "UNSUPPORTED_OPERATION"
    INTERNAL = "INTERNAL"
    # This request, run alone, crashed the model runtime or made inference fail;
    # not retried (it would fail again), every other request of its batch was served.
    POISON_INPUT = "POISON_INPUT"


class ShoalError(Exception):
    """A request that cannot be served, with a code callers can branch on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = ErrorCode(code) if code in ErrorCode.__members__ else code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"
