"""`Intake`: what each request of a delivered message becomes, as decisions the worker's
loop applies (`app.worker.lifecycle.decisions`). Pure: no loop, no broker; the message is
only read (nothing acked, requeued or dead-lettered here)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery.worker import state as worker_state

from app.worker.lifecycle.claims import ClaimFetcher
from app.worker.lifecycle.decisions import Fail, Fetch, Place, Refuse, Reject
from app.worker.lifecycle.entries import Entries
from app.worker.lifecycle.intake import Intake
from app.worker.lifecycle.replies import Replier
from batching.feeder import Waiting
from batching.former import BatchLimits
from batching.lanes import Lane
from batching.latency_model import CostModel
from batching.shapes import Pending
from tasks.envelope import Annotations, Part, coalesce, now_ms, task_body, task_headers
from tasks.errors import ErrorCode
from tasks.names import ENCODE
from tests.fakes import Message

MODEL, STREAMED = "m", "s"


class Worker:
    """Who answers (the replier reads its name and whether Flower listens)."""

    hostname = "w@test"
    event_dispatcher = None


@pytest.fixture
def intake() -> Iterator[Intake]:
    lanes = {m: Lane(m, BatchLimits(max_tokens=10_000, max_items=8), CostModel(0.001, 0, 0))
             for m in (MODEL, STREAMED)}
    claims = ClaimFetcher("", 10.0, lambda fn: None, threads=1)
    yield Intake(Entries(lanes, {}, {STREAMED}, None, True), Replier(Worker()), claims)
    claims.close()


def _annotations(model: str = MODEL, items: int = 1, **kw: Any) -> Annotations:
    return Annotations(model, "encode", items, 10 * items, 10, None, None, **kw)


def single(task_id: str, annotations: Annotations | None = None,
           headers: dict[str, Any] | None = None) -> Message:
    h = task_headers(task_id, ENCODE, annotations or _annotations(), "gw")
    return Message(headers={**h, **(headers or {})},
                   body=task_body({"model": MODEL, "items": [{"text": "t"}]}))


def test_a_request_is_placed_in_its_models_lane_and_its_message_is_left_alone(intake):
    message = single("a", headers={"x-delivery-count": 2})
    (decision,) = intake.take(message)
    assert type(decision) is Place and decision.model == MODEL
    assert decision.held.task_id == "a" and decision.held.delivery.message is message
    assert decision.deliveries == 3  # the broker's count, this delivery included
    assert isinstance(decision.entry, Pending) and decision.entry.handle is decision.held
    assert (message.acks, message.requeues, message.dead) == (0, 0, 0)


def test_a_coalesced_message_becomes_one_decision_per_member_read_at_one_time(intake):
    members = [Part(t, _annotations(), task_body({"items": [{"text": t}]}), returns=r)
               for t, r in (("a", 0), ("b", 1), ("c", 0))]
    message = coalesce(MODEL, "encode", members, "gw")
    decisions = intake.take(Message(headers=message.headers, body=message.body))
    assert [d.held.task_id for d in decisions] == ["a", "b", "c"]
    assert all(type(d) is Place for d in decisions)
    assert len({id(d.held.delivery) for d in decisions}) == 1  # one message, acked once
    assert decisions[0].held.delivery.requests == 3
    assert [d.deliveries for d in decisions] == [1, 2, 1]  # a return counts as a delivery
    assert len({d.entry.received for d in decisions}) == 1  # delivered together


def test_a_continuous_models_request_waits_in_the_feeder(intake):
    (decision,) = intake.take(single("a", _annotations(STREAMED)))
    assert type(decision) is Place and isinstance(decision.entry, Waiting)
    assert decision.entry.key == "a"


def test_a_deadline_becomes_the_entrys_monotonic_deadline(intake):
    deadline = now_ms() + 4_000
    (decision,) = intake.take(single("a", Annotations(
        MODEL, "encode", 1, 10, 10, deadline, deadline - 6_000.0)))
    entry = decision.entry
    assert entry.deadline is not None and 3.0 < entry.deadline - entry.received <= 4.0
    assert entry.budget_s == pytest.approx(6.0)


def test_a_request_with_claims_is_fetched_first(intake):
    (decision,) = intake.take(single("a", _annotations(claims=1)))
    assert decision == Fetch(MODEL, decision.held, 1)
    assert decision.held.delivery.on_acked  # its blobs are deleted once it is acked


def test_a_request_revoked_before_it_came_is_refused_cancelled(intake):
    worker_state.revoked.add("gone")
    try:
        (decision,) = intake.take(single("gone"))
    finally:
        worker_state.revoked.discard("gone")
    assert type(decision) is Refuse and decision.code == ErrorCode.CANCELLED


def test_a_request_for_a_model_not_served_here_fails_before_it_is_held(intake):
    (decision,) = intake.take(single("a", _annotations("other")))
    assert type(decision) is Fail and decision.code == ErrorCode.MODEL_NOT_FOUND
    assert decision.task_id == "a" and "'other'" in decision.why


def test_a_message_nobody_can_read_is_rejected_whole(intake):
    no_id = Message(headers={"task": ENCODE}, body=b"")
    assert intake.take(no_id) == [Reject(no_id)]
    broken = Message(headers={"shoal_coalesced": 1, "task": ENCODE}, body=b"\xc1")
    assert intake.take(broken) == [Reject(broken)]


def test_a_celery_clients_unreadable_body_fails_invalid_request(intake):
    message = Message(headers={"id": "a", "task": ENCODE}, body=b"\xc1not msgpack")
    (decision,) = intake.take(message)
    assert type(decision) is Fail and decision.code == ErrorCode.INVALID_REQUEST
