"""`Feed`: what becomes of the requests waiting for a continuously batching runtime, as
decisions the worker's loop applies (refuse, give back, submit). Pure: a real feeder, and
what the feed reads of the rest (resident, the runtime's room, the queue's consumers) as
plain values."""

from __future__ import annotations

from app.worker.lifecycle.decisions import GiveBack, Refuse, Submit
from app.worker.lifecycle.feed import FEED_POLL_S, Feed
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.replies import Delivery
from batching.feeder import Feeder, Load, Waiting
from tasks.envelope import Annotations
from tasks.errors import ErrorCode
from tests.fakes import Message

MODEL = "s"


def _held(task_id: str) -> Held:
    return Held(Delivery(Message()), task_id, Annotations(MODEL, "generate", 1, 10, 10, None,
                                                          None), b"")


def _feed(resident: bool = True, room: int = 1, peers: int = 1,
          return_after_s: float = 0.2) -> tuple[Feed, Feeder]:
    feeder = Feeder(return_after_s, delivery_limit=-1)
    load = Load(running=0, waiting=0, max_running=room)
    return Feed(feeder, {MODEL}, lambda m: resident, lambda m: load,
                lambda m, now: peers), feeder


def _wait(feeder: Feeder, task_id: str, received: float, deadline: float | None = None
          ) -> Held:
    held = _held(task_id)
    feeder.add(MODEL, Waiting(held, received, deadline, 1, key=task_id))
    return held


def test_what_fits_is_submitted_and_the_rest_polls_for_room():
    feed, feeder = _feed(room=1)
    a, _ = _wait(feeder, "a", 10.0), _wait(feeder, "b", 10.0)
    decisions, wake = feed.feed(10.01)
    assert decisions == [Submit(MODEL, a)]
    assert wake == FEED_POLL_S  # "b" asks again while the runtime has no room
    assert [w.key for w in feeder.waiting[MODEL]] == ["b"]


def test_nothing_is_submitted_while_the_model_loads():
    feed, feeder = _feed(resident=False)
    _wait(feeder, "a", 10.0, deadline=12.0)
    decisions, wake = feed.feed(10.5)
    assert decisions == [] and wake == 1.5  # woken at its deadline


def test_an_expired_request_is_refused_deadline_exceeded():
    feed, feeder = _feed(resident=False)
    late = _wait(feeder, "a", 10.0, deadline=11.0)
    decisions, _ = feed.feed(11.0)
    assert len(decisions) == 1 and type(decisions[0]) is Refuse
    assert decisions[0].held is late and decisions[0].code == ErrorCode.DEADLINE_EXCEEDED
    assert not feeder.waiting[MODEL]


def test_what_waited_too_long_goes_back_while_a_peer_could_take_it():
    feed, feeder = _feed(resident=False, peers=2, return_after_s=0.2)
    old = _wait(feeder, "a", 10.0)
    _wait(feeder, "b", 10.15)
    decisions, wake = feed.feed(10.25)
    assert decisions == [GiveBack(MODEL, [old])]
    assert wake is not None and abs(wake - 0.1) < 1e-9  # "b"'s turn to go back
    # Alone on the queue, nobody else could take it: it waits.
    alone, feeder = _feed(resident=False, peers=1)
    _wait(feeder, "c", 10.0)
    assert alone.feed(20.0) == ([], None)
