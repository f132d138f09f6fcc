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
    # Whether a worker had started it is not known here (`started` None): sent again it may
    # run twice, so clients are told not to retry it as it is (x-should-retry: false).
    return ApiError(
        ErrorCode.DEADLINE_EXCEEDED,
        f"no result within the request's {timeout_s * 1000:.0f} ms deadline; the workers may "
        "be busy or absent, or it may still be running (sent again as it is, it would run "
        "again): allow more time with the X-Timeout-Ms header, or send fewer items",
    )


def unavailable(message: str) -> ApiError:
    return ApiError(ErrorCode.BROKER_UNAVAILABLE, message, retry_after=1)
