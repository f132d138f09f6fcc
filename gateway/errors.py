"""API errors: `{"error": {"code": ..., "message": ...}}` with the right status."""

from __future__ import annotations

from tasks.errors import ErrorCode

STATUS_OF_CODE: dict[str, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
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
    ErrorCode.INTERNAL: 500,
}
RETRYABLE = {429, 503}


class ApiError(Exception):
    def __init__(self, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = str(code)
        self.message = message
        self.status = STATUS_OF_CODE.get(code, 500)
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


def invalid(message: str) -> ApiError:
    return ApiError(ErrorCode.VALIDATION_ERROR, message)
