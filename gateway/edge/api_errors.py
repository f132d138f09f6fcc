"""API errors are `tasks.errors.ShoalError`: one type from the worker to the HTTP body.

`ApiError` is its name on the gateway side, where most errors are raised before
anything is published; `status` (from the code) and `retry_after` are what the
gateway's error handler answers with.
"""

from __future__ import annotations

from tasks.errors import ShoalError as ApiError
from tasks.errors import invalid

__all__ = ["ApiError", "invalid"]
