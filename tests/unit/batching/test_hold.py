import pytest

from batching.former import BatchLimits, take_batch
from batching.hold import (
    HoldLimits,
    MeanRequest,
    credit_opens_in,
    horizon_s,
    may_hold,
    may_return,
    messages_per_batch,
    overflow,
    plan,
    prefetch_for,
    target_prefetch,
    typical_batch_s,
)
from batching.latency_model import CostModel
from batching.shapes import Pending

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

def test_the_horizon_is_capped_in_seconds():
    """Two batches of a slow device are seconds: `max_horizon_s` caps what is kept."""
    slow = CostModel(0.1, 1e-3, 0.0)  # a batch of 4 x 100 padded tokens: 0.5 s
    capped = HoldLimits(horizon_batches=2.0, max_horizon_s=0.3, delivery_limit=20)
    assert typical_batch_s(_uniform(8), LIMITS, slow) == pytest.approx(0.5)
    assert horizon_s(_uniform(8), LIMITS, HOLD, slow) == pytest.approx(1.0)
    assert horizon_s(_uniform(8), LIMITS, capped, slow) == pytest.approx(0.3)
    # batches start at 0, 0.5, 1.0 s: in batches the first three stay, in seconds one
    assert overflow(_uniform(12), LIMITS, HOLD, slow, running_left_s=0.0, now=1.0) == []
    returned = overflow(_uniform(12), LIMITS, capped, slow, running_left_s=0.0, now=1.0)
    assert [p.handle for p in returned] == list(range(4, 12))
    # a cap above the batches' horizon changes nothing
    loose = HoldLimits(horizon_batches=2.0, max_horizon_s=5.0)
    assert horizon_s(_uniform(8), LIMITS, loose, slow) == pytest.approx(1.0)


def test_may_hold_nothing_while_the_running_batch_ends_after_the_horizon():
    mean = MeanRequest.of(_uniform(5))  # 4 a batch, 50 ms each
    capped = HoldLimits(horizon_batches=2.0, max_horizon_s=0.03)
    assert may_hold(None, LIMITS, capped, MODEL, 0.0) is None  # no traffic yet
    assert may_hold(mean, LIMITS, capped, MODEL, 0.031) == 0
    assert credit_opens_in(mean, LIMITS, capped, MODEL, 0.05) == pytest.approx(0.02)
    # from when it ends within the horizon: the next batch (the horizon is less than one)
    assert may_hold(mean, LIMITS, capped, MODEL, 0.03) == 4
    assert may_hold(mean, LIMITS, capped, MODEL, 0.0) == 4
    assert credit_opens_in(mean, LIMITS, capped, MODEL, 0.03) is None
    # a horizon of several batches: that many
    assert may_hold(mean, LIMITS, HOLD, MODEL, 0.05) == 8  # 100 ms = 2 batches
    assert may_hold(mean, LIMITS, HOLD, MODEL, 0.101) == 0
    assert may_hold(mean, LIMITS, HoldLimits(horizon_batches=2.0, max_horizon_s=0.075),
                    MODEL, 0.0) == 6  # 1.5 batches


def test_a_lone_workers_prefetch_follows_the_same_bound():
    """A full batch plus what may be held when it ends: at least the next batch, the
    horizon in batches when that is more (as it was before the cap in seconds)."""
    mean = MeanRequest.of(_uniform(5))
    capped = HoldLimits(horizon_batches=2.0, max_horizon_s=0.03)
    assert prefetch_for(mean, LIMITS, capped, MODEL, 10) == 8
    assert prefetch_for(mean, LIMITS, HOLD, MODEL, 10) == 12  # (1 + 2) x 4


# The policy as a whole, on the real scheduler: tests/unit/batching/test_scheduler.py.
