import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching.cost import BatchShape, CostModel
from batching.former import BatchLimits, Pending, batch_tokens, is_due, split_expired, take_batch
from batching.hold import (
    HoldLimits,
    horizon_s,
    may_return,
    messages_per_batch,
    overflow,
    plan,
    target_prefetch,
    typical_batch_s,
)

MODEL = CostModel(0.01, 1e-4, 0.0)  # a batch of 4 x 100 padded tokens: 50 ms
LIMITS = BatchLimits(max_tokens=100_000, max_items=4, max_wait_s=10.0)
HOLD = HoldLimits(horizon_batches=2.0, delivery_limit=20)


def _uniform(n: int, **kwargs) -> list[Pending]:
    return [Pending(i, "g", 1, 100, 100, received=float(i) * 0.001, **kwargs) for i in range(n)]


def test_may_return_only_up_to_half_the_delivery_limit():
    assert may_return(Pending("m", "g", 1, 1, 1, 0.0, deliveries=1), 20)
    assert may_return(Pending("m", "g", 1, 1, 1, 0.0, deliveries=10), 20)
    assert not may_return(Pending("m", "g", 1, 1, 1, 0.0, deliveries=11), 20)
    assert may_return(Pending("m", "g", 1, 1, 1, 0.0, deliveries=10), 21)
    assert not may_return(Pending("m", "g", 1, 1, 1, 0.0, deliveries=11), 21)
    assert not may_return(Pending("m", "g", 1, 1, 1, 0.0, deliveries=1), 1)
    assert may_return(Pending("m", "g", 1, 1, 1, 0.0, deliveries=1000), -1)  # no limit


def test_plan_is_what_take_batch_would_do_and_leaves_the_backlog_alone():
    backlog = [Pending(i, "g" if i % 3 else "h", 1, 10 * i + 1, 10 * i + 1, float(i))
               for i in range(20)]
    before = list(backlog)
    batches = plan(backlog, LIMITS, MODEL)
    assert backlog == before
    rest = list(backlog)
    assert batches == [take_batch(rest, LIMITS, MODEL) for _ in range(len(batches))]
    assert rest == []
    assert plan([], LIMITS, MODEL) == []


def test_nothing_is_returned_while_the_backlog_fits_the_horizon():
    assert typical_batch_s(_uniform(8), LIMITS, MODEL) == pytest.approx(0.05)
    assert horizon_s(_uniform(8), LIMITS, HOLD, MODEL) == pytest.approx(0.1)
    assert overflow([], LIMITS, HOLD, MODEL, running_left_s=0.0, now=1.0) == []
    assert overflow(_uniform(8), LIMITS, HOLD, MODEL, running_left_s=0.0, now=1.0) == []
    # the third batch starts exactly at the horizon: still kept
    assert overflow(_uniform(12), LIMITS, HOLD, MODEL, running_left_s=0.0, now=1.0) == []


def test_the_newest_requests_beyond_the_horizon_are_returned():
    backlog = _uniform(20)  # 5 batches starting at 0, 50, 100, 150, 200 ms; horizon 100 ms
    before = list(backlog)
    returned = overflow(backlog, LIMITS, HOLD, MODEL, running_left_s=0.0, now=1.0)
    assert [p.handle for p in returned] == list(range(12, 20))
    assert backlog == before  # the caller removes them
    # a long-running batch pushes everything later
    returned = overflow(backlog, LIMITS, HOLD, MODEL, running_left_s=0.04, now=1.0)
    assert [p.handle for p in returned] == list(range(8, 20))  # starts 40, 90, 140 ms...


def test_a_request_past_half_its_delivery_limit_is_never_returned():
    backlog = _uniform(20)
    for p in backlog[14:17]:
        p.deliveries = 11
    returned = overflow(backlog, LIMITS, HOLD, MODEL, running_left_s=0.0, now=1.0)
    assert [p.handle for p in returned] == [12, 13, 17, 18, 19]
    strict = HoldLimits(delivery_limit=1)  # one delivery already spent: nothing may go back
    assert overflow(backlog, LIMITS, strict, MODEL, running_left_s=0.0, now=1.0) == []


def test_a_due_request_is_never_returned():
    limits = BatchLimits(max_tokens=100_000, max_items=4, max_wait_s=0.5)
    backlog = _uniform(20)
    for p in backlog:
        p.received = 0.0 if p.handle < 16 else 0.5
    returned = overflow(backlog, limits, HOLD, MODEL, running_left_s=0.0, now=0.6)
    assert [p.handle for p in returned] == [16, 17, 18, 19]  # 12-15 are due: kept
    assert overflow(backlog, limits, HOLD, MODEL, running_left_s=0.0, now=1.1) == []


def test_the_horizon_is_at_least_the_batching_delay():
    limits = BatchLimits(max_tokens=100_000, max_items=4, max_delay_s=1.0)
    assert typical_batch_s(_uniform(3), limits, MODEL) == 1.0
    assert overflow(_uniform(40), limits, HOLD, MODEL, running_left_s=0.0, now=1.0) == []


def test_target_prefetch_is_running_plus_horizon_batches_clamped():
    assert messages_per_batch(_uniform(5), LIMITS, MODEL) == 4
    assert target_prefetch(_uniform(5), LIMITS, HOLD, MODEL, default=10) == 12  # (1 + 2) x 4
    budget = BatchLimits(max_tokens=1000, max_items=64)
    assert messages_per_batch(_uniform(5), budget, MODEL) == 10  # 10 x 100 padded tokens
    assert target_prefetch(_uniform(5), budget, HOLD, MODEL, default=10) == 30
    wide = BatchLimits(max_tokens=10**9, max_items=1000)
    assert target_prefetch(_uniform(5), wide, HOLD, MODEL, default=10) == 256
    huge = [Pending(0, "g", 8, 8000, 1000, 0.0)]  # over the whole budget: one a batch
    assert target_prefetch(huge, budget, HOLD, MODEL, default=10) == 3
    assert target_prefetch(huge, budget, HoldLimits(min_prefetch=5), MODEL, default=10) == 5
    # nothing to estimate from: the default, clamped
    assert target_prefetch([], LIMITS, HOLD, MODEL, default=10) == 10
    assert target_prefetch([], LIMITS, HOLD, MODEL, default=0) == 1
    assert target_prefetch([], LIMITS, HOLD, MODEL, default=1000) == 256
    # the latency target shrinks batches, hence the prefetch
    quick = BatchLimits(max_tokens=100_000, max_items=64, latency_target_s=0.031)
    assert messages_per_batch(_uniform(5), quick, MODEL) == 2  # 0.01 + 200 x 1e-4 = 0.03
    assert target_prefetch(_uniform(5), quick, HOLD, MODEL, default=10) == 6


# --- a worker simulated with the pure functions ---------------------------------------------
#
# Events are arrivals and batch completions on a fake clock. At each event the worker does
# what the dispatcher does: expire overdue requests, give back the overflow, and (if the
# runtime is idle) take a batch and "run" it for exactly its predicted latency.
#
# The wait bound checked, and why it holds. Let r run at s_r and become due at d_r =
# received + max_wait_s. If s_r <= d_r it waited at most max_wait_s. Otherwise r was held
# at d_r, so the runtime was busy then (an idle runtime with a backlog takes a batch at
# once), with a batch ending at d_r + L_run (L_run <= that batch's predicted latency). From
# then on the batches run back to back until r's. Each of them starts with the oldest held
# request (take_batch's first rule), and r is not in it, so each contains a request older
# than r that was still held at d_r; so there are at most n_older(r) of them, each at most
# L_max (the longest predicted batch latency), and
#     wait(r) <= max_wait_s + L_run + n_older(r) * L_max.
# When r is the oldest request held once it is due (n_older = 0) this is max_wait_s plus
# the rest of the batch that was running: r is in the very next batch. Due requests are
# never returned, so the bound is not dodged by giving them back.


@dataclass
class Outcome:
    kind: str  # "run", "returned" or "expired"
    at: float


@dataclass
class Ran:
    start: float
    end: float
    members: list[Pending] = field(default_factory=list)


def _fits(batch: list[Pending], limits: BatchLimits, model: CostModel) -> bool:
    if sum(p.items for p in batch) > limits.max_items:
        return False
    if batch_tokens(batch, limits.padded) > limits.max_tokens:
        return False
    target = limits.latency_target_s
    return target is None or model.predict(BatchShape.of(batch)) <= target


def _expected_returns(backlog, limits, hold, model, running_left_s, now) -> set[int]:
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


def _check_batch(before: list[Pending], batch: list[Pending], limits, model, now) -> None:
    first = before[0]
    assert batch[0] is first, "the oldest request always runs next"
    assert all(p.group == first.group for p in batch)
    if len(batch) > 1:  # only a lone request may break the budget or the target
        assert _fits(batch, limits, model)
    taken = {id(p) for p in batch}
    due_taken: list[Pending] = []
    for p in before[1:]:
        if p.group != first.group:
            continue
        if id(p) in taken:
            due_taken += [p] if is_due(p, limits, now) else []
        elif is_due(p, limits, now):
            assert not _fits([first, *due_taken, p], limits, model), "a due request lost its turn"


def simulate(arrivals: list[Pending], limits, hold, model):
    outcomes: dict[int, Outcome] = {}
    ran: list[Ran] = []
    backlog: list[Pending] = []
    running: Ran | None = None
    i, t = 0, 0.0

    def settle(p: Pending, kind: str) -> None:
        assert p.handle not in outcomes, "a request settled twice"
        outcomes[p.handle] = Outcome(kind, t)

    while True:
        next_arrival = arrivals[i].received if i < len(arrivals) else math.inf
        if running is not None and running.end <= next_arrival:
            t, running = running.end, None
        elif i < len(arrivals):
            t = next_arrival
            while i < len(arrivals) and arrivals[i].received <= t:
                backlog.append(arrivals[i])
                i += 1
        else:
            break
        for p in split_expired(backlog, t):
            settle(p, "expired")
        running_left = running.end - t if running is not None else 0.0
        expected = _expected_returns(backlog, limits, hold, model, running_left, t)
        returned = overflow(backlog, limits, hold, model, running_left, t)
        assert {p.handle for p in returned} == expected
        for p in returned:
            assert may_return(p, hold.delivery_limit)
            assert not is_due(p, limits, t)
            settle(p, "returned")
        backlog[:] = [p for p in backlog if p not in returned]
        if running is None and backlog:
            before = list(backlog)
            batch = take_batch(backlog, limits, model, now=t)
            _check_batch(before, batch, limits, model, t)
            running = Ran(t, t + model.predict(BatchShape.of(batch)), batch)
            ran.append(running)
            for p in batch:
                settle(p, "run")
    assert not backlog and running is None
    return outcomes, ran


arrival_specs = st.lists(
    st.tuples(
        st.one_of(st.just(0.0), st.floats(0.0, 0.01)),  # gap since the previous arrival, s
        st.sampled_from(["a", "b", "c"]),
        st.integers(1, 4),  # items
        st.integers(1, 128),  # longest
        st.floats(0.2, 1.0),  # real tokens as a share of padded ones
        st.one_of(st.none(), st.floats(0.001, 0.3)),  # deadline, after arrival
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
                     delivery_limit=st.sampled_from([-1, 0, 1, 2, 5, 20, 21]))
sim_models = st.tuples(st.floats(1e-4, 0.01), st.floats(0.0, 3e-5), st.floats(0.0, 1e-7))


def _arrivals(specs) -> list[Pending]:
    t, out = 0.0, []
    for n, (gap, group, items, longest, share, deadline, deliveries) in enumerate(specs):
        t += gap
        out.append(Pending(n, group, items, max(1, round(share * items * longest)), longest,
                           received=t, deadline=None if deadline is None else t + deadline,
                           deliveries=deliveries))
    return out


@settings(max_examples=150, deadline=None, derandomize=True)
@given(arrival_specs, sim_limits, sim_hold, sim_models)
def test_a_simulated_worker_settles_every_request_once_and_in_time(specs, limits, hold, coeffs):
    arrivals = _arrivals(specs)
    model = CostModel(*coeffs, padded=limits.padded)
    outcomes, ran = simulate(arrivals, limits, hold, model)

    assert set(outcomes) == {p.handle for p in arrivals}
    for p in arrivals:
        if outcomes[p.handle].kind == "returned":
            assert may_return(p, hold.delivery_limit)
            if hold.delivery_limit >= 0:
                assert p.deliveries <= hold.delivery_limit // 2
        if outcomes[p.handle].kind == "expired":
            assert p.deadline is not None and p.deadline <= outcomes[p.handle].at
    for run in ran:
        if len(run.members) > 1:
            assert sum(p.items for p in run.members) <= limits.max_items
            assert batch_tokens(run.members, limits.padded) <= limits.max_tokens

    longest_batch = max((r.end - r.start for r in ran), default=0.0)
    left = {handle: outcome.at for handle, outcome in outcomes.items()}
    for r in arrivals:
        if outcomes[r.handle].kind != "run":
            continue
        start, due = outcomes[r.handle].at, r.received + limits.max_wait_s
        if start <= due:
            continue
        busy = [b for b in ran if b.start <= due < b.end]
        assert len(busy) == 1, "a due request was held while the runtime was idle"
        between = [b for b in ran if busy[0].start < b.start < start]
        assert all(any(q.handle < r.handle for q in b.members) for b in between)
        n_older = sum(1 for q in arrivals[: r.handle] if left[q.handle] > due)
        bound = limits.max_wait_s + (busy[0].end - due) + n_older * longest_batch
        assert start - r.received <= bound + 1e-9
        if n_older == 0:
            assert start == busy[0].end
