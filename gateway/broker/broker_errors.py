"""The errors the broker link answers a request with: the broker away, the deadline
passed, a stream cut short. Each is a `ShoalError` the caller's HTTP error handler
turns into its status and Retry-After."""

from __future__ import annotations

from gateway.edge.api_errors import ApiError
from tasks.errors import ErrorCode


def interrupted(why: str) -> ApiError:
    return ApiError(ErrorCode.STREAM_INTERRUPTED,
                    f"the stream was interrupted: {why}; the output so far stands, the rest "
                    "will not come (retry the request)", retry_after=1)


def late(timeout_s: float) -> ApiError:
    return ApiError(
        ErrorCode.DEADLINE_EXCEEDED,
        f"no result within the request's {timeout_s * 1000:.0f} ms deadline "
        "(X-Timeout-Ms); the workers may be busy or absent",
    )


def unavailable(message: str) -> ApiError:
    return ApiError(ErrorCode.BROKER_UNAVAILABLE, message, retry_after=1)
