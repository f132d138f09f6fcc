import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching.former import BatchLimits, Pending, padded_tokens, seconds_to_wait, take_batch

pendings = st.lists(
    st.builds(
        lambda i, group, items, longest: Pending(
            handle=i, group=group, items=items, cost=items * longest, longest=longest,
            received=float(i),
        ),
        st.integers(0, 10_000), st.sampled_from(["a", "b"]), st.integers(1, 40),
        st.integers(1, 300),
    ),
    max_size=60,
)
limits = st.builds(BatchLimits, st.integers(64, 20_000), st.integers(1, 128))


def _fix_order(backlog: list[Pending]) -> list[Pending]:
    for i, p in enumerate(backlog):
        p.received = float(i)
        p.handle = i
    return backlog


@settings(max_examples=300)
@given(pendings, limits)
def test_every_request_is_taken_exactly_once_oldest_first(backlog, limit):
    backlog = _fix_order(backlog)
    original = list(backlog)
    seen: list[int] = []
    while backlog:
        oldest = backlog[0]
        batch = take_batch(backlog, limit)
        assert batch[0] is oldest, "the oldest request must always run next"
        seen += [p.handle for p in batch]
    assert sorted(seen) == [p.handle for p in original]


@settings(max_examples=300)
@given(pendings, limits)
def test_a_batch_respects_budget_and_group(backlog, limit):
    backlog = _fix_order(backlog)
    while backlog:
        batch = take_batch(backlog, limit)
        assert len({p.group for p in batch}) == 1
        if len(batch) > 1:  # one oversized request may run alone
            items = sum(p.items for p in batch)
            assert items <= limit.max_items
            assert padded_tokens(items, max(p.longest for p in batch)) <= limit.max_tokens


def test_batch_fills_in_arrival_order_and_skips_what_does_not_fit():
    limit = BatchLimits(max_tokens=100, max_items=10)
    backlog = [
        Pending("short", "g", 1, 10, 10, 0.0),
        Pending("long", "g", 1, 90, 90, 1.0),  # 2 x 90 padded > 100
        Pending("other-group", "h", 1, 5, 5, 2.0),
        Pending("short2", "g", 2, 20, 10, 3.0),
    ]
    batch = take_batch(backlog, limit)
    assert [p.handle for p in batch] == ["short", "short2"]
    assert [p.handle for p in backlog] == ["long", "other-group"]


def test_idle_runtime_starts_at_once():
    limit = BatchLimits(max_tokens=1000, max_items=64, max_delay_s=0.01)
    backlog = [Pending("a", "g", 1, 5, 5, received=100.0)]
    assert seconds_to_wait(backlog, limit, now=100.0, busy_until=None) == 0.0
    assert seconds_to_wait(backlog, limit, now=100.0, busy_until=50.0) == 0.0


def test_under_load_a_small_batch_waits_at_most_the_delay():
    limit = BatchLimits(max_tokens=1000, max_items=64, max_delay_s=0.01)
    backlog = [Pending("a", "g", 1, 5, 5, received=100.0)]
    assert seconds_to_wait(backlog, limit, now=100.004, busy_until=100.0) == pytest.approx(0.006)
    assert seconds_to_wait(backlog, limit, now=100.009, busy_until=100.008) == pytest.approx(0.001)
    full = [Pending("big", "g", 40, 200, 5, received=100.0)]
    assert seconds_to_wait(full, limit, now=100.001, busy_until=100.0) == 0.0
