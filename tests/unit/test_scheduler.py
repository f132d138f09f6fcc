"""The worker's real scheduler, driven on a fake clock by a model of the broker.

`FakeBroker` is the environment only: it publishes requests at their times,
delivers them while the consumer has credit (prefetch minus unacked), runs a
started batch for its predicted time times a slowdown, and fires the one
timer the scheduler asked for. Every decision is `batching.scheduler`'s.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batching.cost import BatchShape, CostModel
from batching.former import BatchLimits, batch_tokens, is_due, take_batch
from batching.hold import HoldLimits, may_return, target_prefetch, typical_batch_s
from batching.scheduler import PREFETCH_CHANGE_RATIO, Actions, Lane, Scheduler
from batching.shapes import Pending

MODEL = "m"


@dataclass
class Settled:
    kind: str  # "run", "returned", "expired" or "late"
    at: float


@dataclass
class Ran:
    start: float
    end: float
    members: list[Pending]
    consumed: list[Pending]  # members plus those refused as late when it was formed


@dataclass
class FakeBroker:
    scheduler: Scheduler
    peers: int
    slowdown: float = 1.0
    t: float = 0.0
    published: deque[tuple[float, Pending]] = field(default_factory=deque)
    settled: dict[int, Settled] = field(default_factory=dict)
    ran: list[Ran] = field(default_factory=list)
    running: Ran | None = None
    timer: float | None = None
    returns: int = 0
    prefetch_seen: list[int] = field(default_factory=list)

    @property
    def lane(self) -> Lane:
        return self.scheduler.lanes[MODEL]

    def unacked(self) -> int:
        return len(self.lane.backlog) + (len(self.running.members) if self.running else 0)

    def publish(self, at: float, p: Pending) -> None:
        self.published.append((at, p))

    def settle(self, p: Pending, kind: str) -> None:
        assert p.handle not in self.settled, "a request settled twice"
        self.settled[p.handle] = Settled(kind, self.t)

    def deliver(self) -> int:
        n = 0
        while self.published and self.published[0][0] <= self.t \
                and self.unacked() < self.lane.prefetch:
            _, p = self.published.popleft()
            p.received = self.t
            self.scheduler.append(MODEL, p)
            n += 1
        return n

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            candidates = [math.inf]
            if self.published and self.unacked() < self.lane.prefetch:
                candidates.append(max(self.published[0][0], self.t))
            if self.running is not None:
                candidates.append(self.running.end)
            if self.timer is not None:
                candidates.append(self.timer)
            t = min(candidates)
            if t == math.inf:
                break
            self.t = max(self.t, t)
            if self.running is not None and self.running.end <= self.t:
                done, self.running = self.running, None
                batch = self.scheduler.finish(self.t, done.end - done.start)
                assert batch is not None and batch.members == done.members
            if self.timer is not None and self.timer <= self.t:
                self.timer = None
            # Deliver, decide, and deliver again while decisions open credit.
            for _ in range(1000):
                self.deliver()
                self.step()
                if not self.deliver():
                    break
                self.step()
        else:
            pytest.fail("the simulation did not end")
        assert not self.lane.backlog and self.running is None and not self.published

    def step(self) -> Actions:
        lane, t = self.lane, self.t
        before = list(lane.backlog)
        actions = self.scheduler.tick(t)
        hold = self.scheduler.hold
        for model, p in actions.expired:
            assert model == MODEL and p.deadline is not None and p.deadline <= t
            self.settle(p, "expired")
        for _, late in actions.late:
            p = late.pending
            assert p.deadline is not None and t < p.deadline < t + late.predicted_s
            assert late.deadline_in_s == pytest.approx(p.deadline - t)
            self.settle(p, "late")
        if actions.start is not None:
            batch = actions.start
            assert self.running is None, "two batches at once"
            for p in batch.members:
                assert p.deadline is None or p.deadline >= t + batch.predicted_s
                self.settle(p, "run")
            late = [lt.pending for _, lt in actions.late]
            consumed = sorted(batch.members + late, key=lambda p: p.handle)
            if not late:
                live = [p for p in before if p.deadline is None or p.deadline > t]
                check_batch(live, batch.members, lane.limits, lane.cost, t)
            duration = max(batch.predicted_s * self.slowdown, 1e-6)
            self.running = Ran(t, t + duration, batch.members, consumed)
            self.ran.append(self.running)
        returned = [p for _, ps in actions.returned for p in ps]
        if self.peers < 2:
            assert not returned, "a lone worker returned work that would only come back"
        else:
            held = sorted(lane.backlog + returned, key=lambda p: p.handle)
            left = 0.0
            if self.running is not None:
                elapsed = t - self.running.start
                predicted = self.scheduler.running.predicted_s
                left = max(predicted - elapsed, elapsed - predicted, 0.0)
            assert {p.handle for p in returned} == expected_returns(
                held, lane.limits, hold, lane.cost, left, t)
        for p in returned:
            assert may_return(p, hold.delivery_limit) and not is_due(p, lane.limits, t)
            self.settle(p, "returned")
        self.returns += len(returned)
        if returned:
            assert lane.prefetch == max(hold.min_prefetch, len(lane.backlog))
        for prefetch in actions.prefetch.values():
            assert hold.min_prefetch <= prefetch <= hold.max_prefetch
            assert lane.prefetch == prefetch
            self.prefetch_seen.append(prefetch)
        if actions.wake_in is not None:
            assert actions.wake_in > 0
            self.timer = t + actions.wake_in
        if self.running is None and lane.backlog:
            assert self.timer is not None, "work held, the runtime idle and no wake-up asked"
        return actions


def fits(batch: list[Pending], limits: BatchLimits, model: CostModel) -> bool:
    if sum(p.items for p in batch) > limits.max_items:
        return False
    if batch_tokens(batch, limits.padded) > limits.max_tokens:
        return False
    target = limits.latency_target_s
    return target is None or model.predict(BatchShape.of(batch)) <= target


def expected_returns(backlog, limits, hold, model, running_left_s, now) -> set[int]:
    """Recomputed from the definition: members of planned batches that start after the
    horizon, that may be returned and are not due."""
    rest, start, expected = list(backlog), running_left_s, set()
    horizon = hold.horizon_batches * typical_batch_s(backlog, limits, model)
    assert horizon >= hold.horizon_batches * limits.max_delay_s
    while rest:
        batch = take_batch(rest, limits, model, now)
        if start > horizon:
            expected |= {p.handle for p in batch
                         if may_return(p, hold.delivery_limit) and not is_due(p, limits, now)}
        start += model.predict(BatchShape.of(batch))
    return expected


def check_batch(before: list[Pending], batch: list[Pending], limits, model, now) -> None:
    first = before[0]
    assert batch[0] is first, "the oldest request always runs next"
    assert all(p.group == first.group for p in batch)
    if len(batch) > 1:  # only a lone request may break the budget or the target
        assert fits(batch, limits, model)
    taken = {id(p) for p in batch}
    due_taken: list[Pending] = []
    for p in before[1:]:
        if p.group != first.group:
            continue
        if id(p) in taken:
            due_taken += [p] if is_due(p, limits, now) else []
        elif is_due(p, limits, now):
            assert not fits([first, *due_taken, p], limits, model), "a due request lost its turn"


def make(limits: BatchLimits, hold: HoldLimits, model: CostModel, peers: int,
         prefetch: int, slowdown: float = 1.0) -> FakeBroker:
    lane = Lane(MODEL, limits, model)
    scheduler = Scheduler({MODEL: lane}, hold, lambda _model, _now: peers)
    scheduler.prefetch_applied(MODEL, prefetch)
    return FakeBroker(scheduler, peers, slowdown)


# --- the hold policy, every rule at once ------------------------------------------------
#
# The wait bound checked, and why it holds. Let r be delivered at received_r and become
# due at d_r = received_r + max(max_wait_s, max_delay_s). If it started by d_r it waited at
# most that. Otherwise r was held at d_r, so the runtime was busy then: an idle runtime
# with a backlog waits only while the oldest held request has waited less than
# max_delay_s (and asks to be woken when it has), and the oldest has waited at least as
# long as r. The batch running at d_r ends at d_r + L_run. From then on the batches run
# back to back until r's. Each of them is formed starting with the oldest held request
# (take_batch's first rule), and r is not in it, so each consumes (runs, or refuses as
# late) a request older than r that was still held at d_r; so there are at most n_older(r)
# of them, each at most L_max (the longest batch), and
#     wait(r) <= d_r - received_r + L_run + n_older(r) * L_max.
# When r is the oldest request held once it is due (n_older = 0), r is in the very next
# batch. Due requests are never returned, so the bound is not dodged by giving them back.

arrival_specs = st.lists(
    st.tuples(
        st.one_of(st.just(0.0), st.floats(0.0, 0.01)),  # gap since the previous arrival, s
        st.sampled_from(["a", "b", "c"]),
        st.integers(1, 4),  # items
        st.integers(1, 128),  # longest
        st.floats(0.2, 1.0),  # real tokens as a share of padded ones
        st.one_of(st.none(), st.floats(0.001, 0.3)),  # deadline, after publishing
        st.integers(1, 25),  # deliveries
    ),
    min_size=10,
    max_size=60,
)
sim_limits = st.builds(
    BatchLimits,
    max_tokens=st.integers(64, 8192),
    max_items=st.integers(1, 32),
    max_delay_s=st.floats(0.0, 0.02),
    max_wait_s=st.floats(0.0, 0.1),
    padded=st.booleans(),
    latency_target_s=st.one_of(st.none(), st.floats(0.002, 0.1)),
)
sim_hold = st.builds(HoldLimits, horizon_batches=st.floats(0.0, 3.0),
                     delivery_limit=st.sampled_from([-1, 0, 1, 2, 5, 20, 21]),
                     max_prefetch=st.sampled_from([4, 32, 256]))
sim_models = st.tuples(st.floats(1e-4, 0.01), st.floats(0.0, 3e-5), st.floats(0.0, 1e-7))


def publish_all(broker: FakeBroker, specs) -> list[Pending]:
    t, out = 0.0, []
    for n, (gap, group, items, longest, share, deadline, deliveries) in enumerate(specs):
        t += gap
        p = Pending(n, group, items, max(1, round(share * items * longest)), longest,
                    received=t, deadline=None if deadline is None else t + deadline,
                    deliveries=deliveries)
        broker.publish(t, p)
        out.append(p)
    return out


@settings(max_examples=150, deadline=None, derandomize=True)
@given(arrival_specs, sim_limits, sim_hold, sim_models, st.sampled_from([1, 2, 3]),
       st.integers(1, 64), st.sampled_from([0.5, 1.0, 2.0]))
def test_the_scheduler_settles_every_request_once_and_in_time(
        specs, limits, hold, coeffs, peers, prefetch, slowdown):
    broker = make(limits, hold, CostModel(*coeffs, padded=limits.padded), peers,
                  min(prefetch, hold.max_prefetch), slowdown)
    arrivals = publish_all(broker, specs)
    broker.run()
    settled = broker.settled

    assert set(settled) == {p.handle for p in arrivals}
    for p in arrivals:
        if settled[p.handle].kind == "returned":
            assert may_return(p, hold.delivery_limit)
            if hold.delivery_limit >= 0:
                assert p.deliveries <= hold.delivery_limit // 2
    for run in broker.ran:
        if len(run.members) > 1:
            assert sum(p.items for p in run.members) <= limits.max_items
            assert batch_tokens(run.members, limits.padded) <= limits.max_tokens

    longest_batch = max((r.end - r.start for r in broker.ran), default=0.0)
    left = {handle: s.at for handle, s in settled.items()}
    patience = max(limits.max_wait_s, limits.max_delay_s)
    for r in arrivals:
        if settled[r.handle].kind != "run":
            continue
        start, due = settled[r.handle].at, r.received + patience
        if start <= due:
            continue
        busy = [b for b in broker.ran if b.start <= due < b.end]
        assert len(busy) == 1, "a due request was held while the runtime was idle"
        between = [b for b in broker.ran if busy[0].start < b.start < start]
        assert all(any(q.handle < r.handle for q in b.consumed) for b in between)
        n_older = sum(1 for q in arrivals[: r.handle]
                      if q.received <= due and left[q.handle] > due)
        bound = patience + (busy[0].end - due) + n_older * longest_batch
        assert start - r.received <= bound + 1e-9
        if n_older == 0:
            assert start == busy[0].end


# --- single rules ------------------------------------------------------------------------

LIMITS = BatchLimits(max_tokens=100_000, max_items=4, max_wait_s=10.0)
HOLD = HoldLimits(horizon_batches=2.0, delivery_limit=20)


def uniform(n: int, start: int = 0, **kwargs) -> list[Pending]:
    return [Pending(start + i, "g", 1, 100, 100, received=0.0, **kwargs) for i in range(n)]


def test_an_idle_runtime_starts_a_lone_request_at_once():
    limits = BatchLimits(max_tokens=1000, max_items=8, max_delay_s=0.5)
    broker = make(limits, HOLD, CostModel(0.01, 1e-4), peers=1, prefetch=8)
    broker.scheduler.append(MODEL, Pending(0, "g", 1, 10, 10, received=0.0))
    actions = broker.scheduler.tick(0.0)
    assert actions.start is not None and [p.handle for p in actions.start.members] == [0]


def test_under_load_the_runtime_waits_for_a_fuller_batch_and_asks_to_be_woken():
    limits = BatchLimits(max_tokens=10_000, max_items=8, max_delay_s=0.02)
    scheduler = make(limits, HOLD, CostModel(0.01, 1e-4), peers=1, prefetch=8).scheduler
    scheduler.append(MODEL, Pending(0, "g", 1, 10, 10, received=0.0))
    first = scheduler.tick(0.0).start
    assert first is not None
    scheduler.finish(0.010, 0.010)
    scheduler.append(MODEL, Pending(1, "g", 1, 10, 10, received=0.012))
    waiting = scheduler.tick(0.012)  # busy a moment ago: worth waiting
    assert waiting.start is None and waiting.wake_in == pytest.approx(0.02)
    scheduler.append(MODEL, Pending(2, "g", 1, 10, 10, received=0.02))
    woken = scheduler.tick(0.032)
    assert woken.start is not None and [p.handle for p in woken.start.members] == [1, 2]


def test_a_request_that_would_finish_after_its_deadline_is_refused_not_run():
    scheduler = make(LIMITS, HOLD, CostModel(0.05, 0.0), peers=1, prefetch=8).scheduler
    scheduler.append(MODEL, Pending(0, "g", 1, 10, 10, received=0.0, deadline=0.03))
    scheduler.append(MODEL, Pending(1, "g", 1, 10, 10, received=0.0, deadline=0.2))
    actions = scheduler.tick(0.0)
    assert [(m, lt.pending.handle) for m, lt in actions.late] == [(MODEL, 0)]
    assert actions.late[0][1].predicted_s == pytest.approx(0.05)
    assert actions.start is not None and [p.handle for p in actions.start.members] == [1]
    # all of a batch late: the next one is tried at once
    scheduler.finish(0.05, 0.05)
    scheduler.append(MODEL, Pending(2, "g", 1, 10, 10, received=0.05, deadline=0.06))
    scheduler.append(MODEL, Pending(3, "h", 1, 10, 10, received=0.06))
    actions = scheduler.tick(0.06 - 1e-9)
    assert [lt.pending.handle for _, lt in actions.late] == [2]
    assert actions.start is not None and [p.handle for p in actions.start.members] == [3]


def test_the_oldest_lane_goes_first():
    lanes = {m: Lane(m, LIMITS, CostModel(0.01, 0.0)) for m in ("x", "y")}
    scheduler = Scheduler(lanes, HOLD, lambda _m, _now: 1)
    scheduler.append("y", Pending(0, "g", 1, 10, 10, received=1.0))
    scheduler.append("x", Pending(1, "g", 1, 10, 10, received=2.0))
    actions = scheduler.tick(2.0)
    assert actions.start is not None and actions.start.lane.model == "y"


def test_a_lone_worker_keeps_everything_and_a_worker_with_a_peer_returns_the_overflow():
    cost = CostModel(0.01, 1e-4, 0.0)  # a batch of 4 x 100 padded tokens: 50 ms
    for peers, kept in ((1, 16), (2, 8)):
        scheduler = make(LIMITS, HOLD, cost, peers=peers, prefetch=64).scheduler
        for p in uniform(20):
            scheduler.append(MODEL, p)
        actions = scheduler.tick(0.0)
        assert actions.start is not None and len(actions.start.members) == 4
        assert len(scheduler.lanes[MODEL].backlog) == kept
        returned = [p.handle for _, ps in actions.returned for p in ps]
        assert returned == ([] if peers == 1 else list(range(12, 20)))
        if peers == 2:  # the credit shrinks to what is kept, before the rejects go out
            assert actions.prefetch == {MODEL: 8}


def test_a_batch_that_overruns_its_prediction_is_looked_at_again():
    cost = CostModel(0.01, 1e-4, 0.0)
    scheduler = make(LIMITS, HOLD, cost, peers=2, prefetch=64).scheduler
    for p in uniform(12):
        scheduler.append(MODEL, p)
    actions = scheduler.tick(0.0)
    assert actions.returned == []  # batches at 0, 50, 100 ms: within the horizon
    assert actions.wake_in == pytest.approx(0.075)  # 1.5 x its 50 ms
    overrun = scheduler.tick(0.075)
    assert overrun.start is None
    assert overrun.wake_in == pytest.approx(0.25)  # then every prediction, at least 250 ms
    late = scheduler.tick(0.3)  # 250 ms past its prediction: assumed to overrun as much again
    assert [p.handle for _, ps in late.returned for p in ps] == list(range(4, 12))


@pytest.mark.parametrize(("max_items", "horizon"), [(32, 2.0), (8, 1.0), (64, 3.0)])
def test_after_returns_stop_prefetch_grows_back_to_what_the_traffic_calls_for(max_items,
                                                                               horizon):
    """The sequence seen on a running stack: large requests make a worker with a peer
    return work and shrink its prefetch; then only 1-item requests come."""
    limits = BatchLimits(max_tokens=100_000, max_items=max_items, max_wait_s=10.0)
    hold = HoldLimits(horizon_batches=horizon, delivery_limit=20)
    broker = make(limits, hold, CostModel(0.005, 2e-5), peers=2, prefetch=hold.max_prefetch)
    for i in range(64):  # each fills a batch on its own
        broker.publish(0.0, Pending(i, "g", max_items, 64 * 100, 100, received=0.0))
    broker.run()
    assert broker.returns > 0
    after_returns = broker.lane.prefetch
    small = [Pending(1000 + i, "g", 1, 10, 10, received=0.0) for i in range(400)]
    called_for = target_prefetch(small[:8], limits, hold, broker.lane.cost, default=1)
    assert after_returns * PREFETCH_CHANGE_RATIO < called_for
    t = broker.t
    for i, p in enumerate(small):
        broker.publish(t + 0.001 * i, p)
    broker.run()
    assert called_for / PREFETCH_CHANGE_RATIO < broker.lane.prefetch <= called_for


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(2, 64), st.floats(0.5, 3.0), st.integers(1, 64), st.integers(1, 200),
       sim_models)
def test_prefetch_settles_near_what_a_steady_mix_calls_for(max_items, horizon, items,
                                                           longest, coeffs):
    limits = BatchLimits(max_tokens=8192, max_items=max_items, max_wait_s=10.0)
    hold = HoldLimits(horizon_batches=horizon, delivery_limit=20)
    broker = make(limits, hold, CostModel(*coeffs), peers=1, prefetch=1)
    requests = [Pending(i, "g", items, items * longest, longest, received=0.0)
                for i in range(300)]
    for i, p in enumerate(requests):
        broker.publish(0.0005 * i, p)
    broker.run()
    called_for = target_prefetch(requests[:4], limits, hold, broker.lane.cost, default=1)
    assume(called_for >= hold.min_prefetch)
    lo, hi = called_for / PREFETCH_CHANGE_RATIO, called_for * PREFETCH_CHANGE_RATIO
    assert lo < broker.lane.prefetch < hi
