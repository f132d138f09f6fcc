"""What each request's caller is sent (`app.worker.lifecycle.answers.reply_to`, `refusal`):
decisions, asserted on without publishing anything."""

from __future__ import annotations

from app.worker.lifecycle.answers import Reply, refusal, reply_to
from app.worker.lifecycle.held import Held, Split
from app.worker.lifecycle.replies import Delivery
from runtimes.base import Outcome
from tasks.envelope import Annotations
from tasks.errors import ErrorCode
from tests.fakes import Message


def _annotations(items: int) -> Annotations:
    return Annotations("m", "encode", items, 10 * items, 10, None, None)


def _whole(task_id: str = "a") -> Held:
    return Held(Delivery(Message()), task_id, _annotations(3), b"")


def _parts(n: int) -> tuple[Held, list[Held]]:
    """A request of `n` one-item parts, and each part's `Held`."""
    whole = _whole()
    split = Split([(_annotations(1), b"") for _ in range(n)])
    return whole, [split.part_held(whole, i) for i in range(n)]


def _ok(task_id: str, count: int = 1) -> Outcome:
    return Outcome(task_id, result={"output": "dense", "count": count, "dims": 2,
                                    "dtype": "float32", "embeddings": bytes(8 * count)})


def test_a_request_that_ran_gets_its_own_outcome():
    held, outcome = _whole(), _ok("a")
    assert reply_to(held, outcome) == Reply(outcome)
    failed = Outcome("a", error_code=ErrorCode.POISON_INPUT, error_message="it broke")
    assert reply_to(held, failed) == Reply(failed)


def test_a_restarting_runtimes_refusal_says_when_to_come_back_in_whole_seconds():
    outcome = Outcome("a", error_code=ErrorCode.MODEL_UNAVAILABLE, error_message="restarting",
                      stats={"retry_after_s": 2.4})
    reply = reply_to(_whole(), outcome)
    assert reply is not None and reply.retry_after == 3 and not reply.refused


def test_a_split_request_is_answered_once_with_its_parts_joined():
    _, (first, second) = _parts(2)
    split = first.split
    assert split is not None
    split.results.append(_ok("a").result or {})
    assert reply_to(first, _ok("a")) is None  # a part left to run: nothing yet
    split.results.append(_ok("a").result or {})
    reply = reply_to(second, _ok("a"))
    assert reply is not None and reply.outcome.ok
    assert reply.outcome.result is not None and reply.outcome.result["count"] == 2
    assert reply_to(second, _ok("a")) is None  # answered already


def test_a_split_requests_failure_names_its_part_and_ends_it():
    _, (first, second) = _parts(2)
    reply = reply_to(first, Outcome("a", error_code=ErrorCode.POISON_INPUT,
                                    error_message="it broke"))
    assert reply is not None
    assert reply.outcome.error_message == "item 0 (part 1 of 2): it broke"
    assert refusal(second, "late", ErrorCode.DEADLINE_EXCEEDED) is None  # answered already


def test_a_refusal_says_it_did_not_run_unless_parts_of_it_did():
    reply = refusal(_whole(), "too late", ErrorCode.DEADLINE_EXCEEDED)
    assert reply == Reply(Outcome("a", error_code=ErrorCode.DEADLINE_EXCEEDED,
                                  error_message="too late"), refused=True, ran=False)
    _, (first, second) = _parts(2)
    assert first.split is not None
    first.split.results.append(_ok("a").result or {})  # its first part ran
    reply = refusal(second, "too late", ErrorCode.DEADLINE_EXCEEDED)
    assert reply is not None and reply.ran
    assert reply.outcome.error_message == "item 1 (part 2 of 2): too late"
