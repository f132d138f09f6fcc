"""One error type: its HTTP status, its body, and its Celery FAILURE both ways."""

from __future__ import annotations

import pytest
from celery.backends.base import Backend

from gateway.edge.api_errors import ApiError, invalid
from tasks.celery_app import app
from tasks.errors import STATUS_OF_CODE, ErrorCode, ShoalError


def test_the_gateways_error_is_shoals():
    assert ApiError is ShoalError
    error = invalid("options.dtype must be one of [...]")
    assert (error.code, error.status) == (ErrorCode.VALIDATION_ERROR, 422)
    assert error.body() == {"error": {"code": "VALIDATION_ERROR",
                                      "message": "options.dtype must be one of [...]"}}


def test_every_code_has_a_status_and_unknown_codes_are_500():
    assert set(STATUS_OF_CODE) == set(ErrorCode)
    assert ShoalError(ErrorCode.QUEUE_FULL, "full", retry_after=1).status == 429
    assert ShoalError("SOMETHING_NEW", "?").status == 500


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_failure_reads_back_as_the_error_it_carries(code):
    failure = ShoalError(code, f"{code} happened").as_celery_failure()
    assert failure == {"exc_type": "ShoalError", "exc_message": [str(code), f"{code} happened"],
                       "exc_module": "tasks.errors"}
    back = ShoalError.from_celery_failure(failure)
    assert (back.code, back.message, back.status) == (code, f"{code} happened",
                                                       STATUS_OF_CODE[code])


@pytest.mark.parametrize("meta", [
    {"exc_type": "KeyError", "exc_message": ["x"], "exc_module": "builtins"},
    {"exc_type": "ShoalError", "exc_message": "not a pair"},
    "a worker that answered a string",
])
def test_any_other_failure_is_internal(meta):
    error = ShoalError.from_celery_failure(meta)
    assert (error.code, error.status) == (ErrorCode.INTERNAL, 500)
    assert error.message.startswith("worker error")


def test_a_retry_after_travels_with_a_celery_failure_and_celery_ignores_it():
    """A restarting runtime's MODEL_UNAVAILABLE says when to come back: the gateway sends
    it as Retry-After; a Celery client rebuilds the error from the usual three keys."""
    failure = ShoalError(ErrorCode.MODEL_UNAVAILABLE, "restarting", retry_after=3)
    meta = failure.as_celery_failure()
    again = ShoalError.from_celery_failure(meta)
    assert (again.code, again.status, again.retry_after) == (
        ErrorCode.MODEL_UNAVAILABLE, 503, 3)
    assert ShoalError.from_celery_failure({**meta, "retry_after": "3"}).retry_after is None
    assert "retry_after" not in ShoalError(ErrorCode.INTERNAL, "x").as_celery_failure()
    rebuilt = Backend(app).exception_to_python(meta)
    assert isinstance(rebuilt, ShoalError) and rebuilt.args == ("MODEL_UNAVAILABLE", "restarting")


def test_whether_a_retry_can_help_is_known_per_code():
    """x-should-retry: the fleet or a store away or full may come back; a refusal of the
    request itself, or INTERNAL, would fail again."""
    assert ShoalError(ErrorCode.MODEL_UNAVAILABLE, "x", retry_after=1).retryable
    assert ShoalError(ErrorCode.QUEUE_FULL, "x").retryable
    for code in (ErrorCode.VALIDATION_ERROR, ErrorCode.DEADLINE_TOO_SHORT,
                 ErrorCode.POISON_INPUT, ErrorCode.INTERNAL, ErrorCode.MODEL_NOT_FOUND):
        assert not ShoalError(code, "x").retryable, code


def test_a_deadline_exceeded_is_retryable_only_when_it_did_not_start():
    # Refused unrun by a worker: nothing ran, sending it again may fit.
    assert ShoalError(ErrorCode.DEADLINE_EXCEEDED, "x", started=False).retryable
    # Ran, or not known (the gateway stopped waiting): it would run again.
    assert not ShoalError(ErrorCode.DEADLINE_EXCEEDED, "x", started=True).retryable
    assert not ShoalError(ErrorCode.DEADLINE_EXCEEDED, "x").retryable


def test_started_travels_beside_celery_s_keys_and_param_stays_home():
    error = ShoalError(ErrorCode.DEADLINE_EXCEEDED, "late", started=False, param="items")
    meta = error.as_celery_failure()
    assert meta["started"] is False and "param" not in meta
    assert error.args == ("DEADLINE_EXCEEDED", "late")  # Celery's args are (code, message)
    again = ShoalError.from_celery_failure(meta)
    assert again.started is False and again.retryable and again.param is None
    assert ShoalError.from_celery_failure({**meta, "started": "no"}).started is None
    assert "started" not in ShoalError(ErrorCode.INTERNAL, "x").as_celery_failure()
    rebuilt = Backend(app).exception_to_python(meta)
    assert isinstance(rebuilt, ShoalError) and rebuilt.args == ("DEADLINE_EXCEEDED", "late")
