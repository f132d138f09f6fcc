"""`Holdings`: each held request's state, set by its transitions and read from one registry
(`app.worker.lifecycle.held`), over a real scheduler and feeder."""

from __future__ import annotations

import time

from app.worker.lifecycle.entries import Entries
from app.worker.lifecycle.held import (
    FETCHING,
    GENERATING,
    PARKED,
    RUNNING,
    SCHEDULED,
    SETTLED,
    WAITING,
    Held,
    Holdings,
)
from app.worker.lifecycle.replies import Delivery
from batching.feeder import Feeder, Load, Waiting
from batching.former import BatchLimits
from batching.hold import HoldLimits
from batching.lanes import Lane
from batching.latency_model import CostModel
from batching.pool import lora_key
from batching.scheduler import Scheduler
from tasks.envelope import Annotations
from tests.fakes import Message

MODEL = "m"


def _holdings() -> tuple[Holdings, Entries]:
    lanes = {MODEL: Lane(MODEL, BatchLimits(max_tokens=10_000, max_items=2),
                         CostModel(0.001, 0.0, 0.0))}
    lanes[MODEL].ready = True
    scheduler = Scheduler(lanes, HoldLimits(horizon_batches=1.0, max_horizon_s=0.5),
                          lambda model, now: 1)
    return Holdings(scheduler, Feeder(0.2, -1)), Entries(lanes, {}, set(), None, True)


def _held(task_id: str, lora: str | None = None) -> Held:
    return Held(Delivery(Message()), task_id,
                Annotations(MODEL, "encode", 1, 10, 10, None, None, lora), b"")


def test_a_request_moves_from_scheduled_to_running_to_settled():
    holdings, entries = _holdings()
    a, b = _held("a"), _held("b")
    for held in (a, b):
        holdings.schedule(MODEL, entries.pending(held, 1))
    assert a.state == b.state == SCHEDULED and holdings.unfinished == 2
    batch = holdings.scheduler.tick(time.monotonic()).start
    assert batch is not None
    holdings.run(batch)
    assert holdings.counts() == {(MODEL, RUNNING): 2}
    assert holdings.running_ids() == {"a", "b"}
    holdings.settle_all([a, b])
    assert a.state == SETTLED and holdings.empty and not holdings.counts()


def test_what_has_not_started_is_taken_out_and_settled_wherever_it_waits():
    holdings, entries = _holdings()
    scheduled, parked, fetching = _held("s"), _held("p", lora="style"), _held("f")
    holdings.schedule(MODEL, entries.pending(scheduled, 1))
    holdings.park(MODEL, "style", parked, 1)
    holdings.fetch(MODEL, fetching)
    assert holdings.counts() == {(MODEL, SCHEDULED): 1, (MODEL, PARKED): 1,
                                 (MODEL, FETCHING): 1}
    # What requests use may not be evicted; a fetch asks for nothing yet.
    assert holdings.in_use() == {MODEL: 2, lora_key(MODEL, "style"): 1}
    back = holdings.not_started(MODEL)
    assert {h.task_id for h in back} == {"s", "p", "f"}
    assert all(h.state == SETTLED for h in back) and holdings.empty
    assert not holdings.fetched(fetching)  # its fetch's end finds it handed back


def test_a_revoke_withdraws_only_what_has_not_started():
    holdings, _ = _holdings()
    waiting, running = _held("w"), _held("r")
    holdings.wait(MODEL, Waiting(running, time.monotonic(), None, 1, key="r"))
    holdings.wait(MODEL, Waiting(waiting, time.monotonic(), None, 1, key="w"))
    (taken,) = holdings.feeder.take(MODEL, Load(running=0, waiting=0, max_running=1))
    holdings.generate(MODEL, taken.handle)
    assert waiting.state == WAITING and running.state == GENERATING
    assert holdings.withdraw({"w", "r"}) == [(MODEL, waiting)]
    assert waiting.state == SETTLED
    assert [h.task_id for h in holdings.running()] == ["r"]


def test_unparked_requests_stay_held_until_scheduled_or_settled():
    holdings, entries = _holdings()
    parked = _held("p", lora="style")
    holdings.park(MODEL, "style", parked, 2)
    assert holdings.parked_loras(MODEL) == ["style"]
    ((held, deliveries),) = holdings.unpark(MODEL, "style")
    assert held is parked and deliveries == 2 and not holdings.empty
    holdings.schedule(MODEL, entries.pending(held, deliveries))
    assert holdings.counts() == {(MODEL, SCHEDULED): 1}
    holdings.clear()
    assert holdings.empty and not holdings.scheduler.lanes[MODEL].backlog
