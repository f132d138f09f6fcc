import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching.former import (
    BatchLimits,
    Pending,
    batch_tokens,
    is_due,
    is_full,
    padded_tokens,
    seconds_to_wait,
    split_expired,
    take_batch,
)
from batching.latency_model import BatchShape, CostModel

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


# --- closest-length filling, max_wait_s, latency target, expiry ---------------------------


def _arrival_order(backlog: list[Pending], limit: BatchLimits) -> list[Pending]:
    """The first version's rule, as a baseline: fill in arrival order."""
    first, chosen = backlog[0], [backlog[0]]
    for p in backlog[1:]:
        trial = [*chosen, p]
        items = sum(q.items for q in trial)
        if p.group == first.group and items <= limit.max_items \
                and batch_tokens(trial, True) <= limit.max_tokens:
            chosen = trial
    return chosen


def _fits(batch: list[Pending], limit: BatchLimits, model: CostModel | None) -> bool:
    if sum(p.items for p in batch) > limit.max_items:
        return False
    if batch_tokens(batch, limit.padded) > limit.max_tokens:
        return False
    if model is None or limit.latency_target_s is None:
        return True
    return model.predict(BatchShape.of(batch)) <= limit.latency_target_s


def test_closest_length_filling_cuts_padding_compared_with_arrival_order():
    limit = BatchLimits(max_tokens=1000, max_items=4)
    lengths = [100, 250, 240, 100, 300, 95, 110, 240]
    backlog = [Pending(i, "g", 1, n, n, float(i)) for i, n in enumerate(lengths)]
    baseline = _arrival_order(list(backlog), limit)
    batch = take_batch(backlog, limit)
    assert [p.longest for p in baseline] == [100, 250, 240, 100]
    assert [p.longest for p in batch] == [100, 100, 95, 110]
    assert batch_tokens(batch, True) == 440 < batch_tokens(baseline, True) == 1000
    # the long ones are left together for the next batch, in arrival order
    assert [p.longest for p in backlog] == [250, 240, 300, 240]
    assert [p.longest for p in take_batch(backlog, limit)] == [250, 240, 240]  # 4 x 300 > 1000


def test_on_equal_distance_the_shorter_request_wins_then_the_older():
    limit = BatchLimits(max_tokens=10_000, max_items=2)
    backlog = [Pending("first", "g", 1, 100, 100, 0.0), Pending("longer", "g", 1, 110, 110, 1.0),
               Pending("shorter", "g", 1, 90, 90, 2.0), Pending("shorter2", "g", 1, 90, 90, 3.0)]
    assert [p.handle for p in take_batch(backlog, limit)] == ["first", "shorter"]
    limit = BatchLimits(max_tokens=10_000, max_items=3)
    backlog = [Pending("first", "g", 1, 100, 100, 0.0), Pending("a", "g", 1, 120, 120, 1.0),
               Pending("b", "g", 1, 120, 120, 2.0), Pending("c", "g", 1, 120, 120, 3.0)]
    assert [p.handle for p in take_batch(backlog, limit)] == ["first", "a", "b"]


def test_an_overdue_request_of_the_group_joins_before_better_fitting_fresh_ones():
    limit = BatchLimits(max_tokens=10_000, max_items=3, max_wait_s=0.5)
    backlog = [
        Pending("first", "g", 1, 100, 100, received=0.0),
        Pending("old-long", "g", 1, 400, 400, received=0.1),
        Pending("other-group", "h", 1, 100, 100, received=0.2),
        Pending("fresh1", "g", 1, 100, 100, received=0.9),
        Pending("fresh2", "g", 1, 100, 100, received=1.0),
    ]
    # not yet due: closest-length filling prefers the fresh short ones
    assert [p.handle for p in take_batch(list(backlog), limit, now=0.55)] == [
        "first", "fresh1", "fresh2"]
    assert [p.handle for p in take_batch(list(backlog), limit)] == ["first", "fresh1", "fresh2"]
    # due (older than max_wait_s): it goes into the very next batch
    rest = list(backlog)
    assert [p.handle for p in take_batch(rest, limit, now=1.0)] == ["first", "old-long", "fresh1"]
    assert [p.handle for p in rest] == ["other-group", "fresh2"]


def test_a_due_request_that_does_not_fit_is_skipped_for_a_due_one_that_does():
    limit = BatchLimits(max_tokens=1000, max_items=8, max_wait_s=0.5)
    backlog = [
        Pending("first", "g", 1, 100, 100, received=0.0),
        Pending("due-huge", "g", 1, 900, 900, received=0.1),  # 2 x 900 > 1000
        Pending("due-small", "g", 1, 300, 300, received=0.2),
        Pending("fresh", "g", 1, 100, 100, received=2.0),
    ]
    batch = take_batch(backlog, limit, now=2.0)
    assert [p.handle for p in batch] == ["first", "due-small", "fresh"]
    assert batch_tokens(batch, True) == 900
    assert [p.handle for p in backlog] == ["due-huge"]


def test_the_latency_target_stops_a_batch_from_growing():
    model = CostModel(0.01, 1e-4, 0.0)  # 100 padded tokens cost 10 ms
    limit = BatchLimits(max_tokens=100_000, max_items=64, latency_target_s=0.055)
    backlog = [Pending(i, "g", 1, 100, 100, float(i)) for i in range(10)]
    batch = take_batch(backlog, limit, model)
    assert len(batch) == 4  # 0.01 + 400 x 1e-4 = 0.05 <= 0.055 < 0.06
    assert model.predict(BatchShape.of(batch)) <= 0.055
    # without a cost model there is nothing to predict with: only the budget counts
    assert len(take_batch(backlog, limit)) == 6
    # a request predicted slower than the target on its own still runs, alone
    backlog = [Pending("big", "g", 1, 1000, 1000, 0.0), Pending("small", "g", 1, 1, 1, 1.0)]
    assert [p.handle for p in take_batch(backlog, limit, model)] == ["big"]


def test_unpadded_budget_counts_real_tokens():
    backlog = [Pending("a", "g", 4, 40, 100, 0.0), Pending("b", "g", 4, 40, 100, 1.0)]
    assert batch_tokens(backlog, padded=True) == 800
    assert batch_tokens(backlog, padded=False) == 80
    assert len(take_batch(list(backlog), BatchLimits(max_tokens=100, max_items=64))) == 1
    assert len(take_batch(list(backlog), BatchLimits(100, 64, padded=False))) == 2
    assert is_full(backlog, BatchLimits(max_tokens=1000, max_items=64))
    assert not is_full(backlog, BatchLimits(max_tokens=1000, max_items=64, padded=False))


def test_split_expired_removes_what_is_past_its_deadline():
    backlog = [
        Pending("none", "g", 1, 5, 5, 0.0),
        Pending("past", "g", 1, 5, 5, 0.0, deadline=9.0),
        Pending("now", "h", 1, 5, 5, 1.0, deadline=10.0),
        Pending("future", "g", 1, 5, 5, 2.0, deadline=10.5),
    ]
    assert [p.handle for p in split_expired(backlog, now=10.0)] == ["past", "now"]
    assert [p.handle for p in backlog] == ["none", "future"]
    assert split_expired(backlog, now=10.0) == []
    assert [p.handle for p in split_expired(backlog, now=11.0)] == ["future"]
    assert [p.handle for p in backlog] == ["none"]


richer_limits = st.builds(
    BatchLimits,
    max_tokens=st.integers(64, 20_000),
    max_items=st.integers(1, 128),
    max_wait_s=st.floats(0.0, 30.0),
    padded=st.booleans(),
    latency_target_s=st.one_of(st.none(), st.floats(0.001, 0.5)),
)
models = st.builds(CostModel, st.floats(0.0, 0.01), st.floats(0.0, 1e-4), st.floats(0.0, 1e-6),
                   padded=st.booleans())


@settings(max_examples=300, deadline=None, derandomize=True)
@given(pendings, richer_limits, st.one_of(st.none(), models), st.floats(0.0, 20_000.0))
def test_every_batch_is_maximal_and_takes_due_requests_first(backlog, limit, model, now):
    """Whatever is left of the batch's group does not fit; a due request is left
    only if it did not fit beside the first request and the due ones before it."""
    backlog = _fix_order(backlog)
    for p in backlog:
        p.cost = max(1, p.cost // 2)  # real tokens below padded ones
    while backlog:
        before = list(backlog)
        batch = take_batch(backlog, limit, model, now)
        first = before[0]
        assert batch[0] is first and all(p.group == first.group for p in batch)
        assert len(batch) == 1 or _fits(batch, limit, model)
        assert sorted(p.handle for p in batch + backlog) == [p.handle for p in before]
        assert [p.handle for p in batch] == sorted(p.handle for p in batch)  # arrival order
        assert [p.handle for p in backlog] == sorted(p.handle for p in backlog)
        taken = {id(p) for p in batch}
        due_before: list[Pending] = []
        for p in before[1:]:
            if p.group != first.group:
                continue
            due = is_due(p, limit, now)
            if id(p) in taken:
                if due:
                    due_before.append(p)
                continue
            assert not _fits([*batch, p], limit, model), "a request that fits was left out"
            if due:
                assert not _fits([first, *due_before, p], limit, model), "a due request lost"


def test_two_requests_with_one_id_never_share_a_batch():
    # A gateway that republished after a reconnect, or a job part published again after a
    # takeover, leaves two messages with one task id; the runtime answers a batch by id.
    backlog = [Pending("first", "g", 1, 10, 10, 0.0, key="t1"),
               Pending("copy", "g", 1, 10, 10, 1.0, key="t1"),
               Pending("other", "g", 1, 10, 10, 2.0, key="t2"),
               Pending("no-id", "g", 1, 10, 10, 3.0),
               Pending("no-id-2", "g", 1, 10, 10, 4.0)]
    limits = BatchLimits(max_tokens=1_000, max_items=10, max_wait_s=0.0)
    assert [p.handle for p in take_batch(backlog, limits, now=10.0)] \
        == ["first", "other", "no-id", "no-id-2"]
    assert [p.handle for p in take_batch(backlog, limits, now=10.0)] == ["copy"]


def test_a_request_a_caller_waits_for_goes_before_older_job_parts_of_its_group():
    limits = BatchLimits(max_tokens=100_000, max_items=8)
    parts = [Pending(i, "g", 1, 10, 10, received=float(i), bulk=True) for i in range(3)]
    waited = [Pending(i, "g", 1, 10, 10, received=float(i)) for i in range(3, 5)]
    backlog = parts + waited
    # A batch led by a waited-for request takes no part, though the parts are older.
    assert [p.handle for p in take_batch(backlog, limits, now=10.0)] == [3, 4]
    assert [p.handle for p in take_batch(backlog, limits, now=10.0)] == [0, 1, 2]
    assert backlog == []


def test_on_the_parts_turn_the_oldest_part_leads_and_may_take_anything_of_its_group():
    limits = BatchLimits(max_tokens=100_000, max_items=3)
    backlog = [Pending(0, "g", 1, 10, 10, received=0.0, bulk=True),
               Pending(1, "g", 1, 10, 10, received=1.0),
               Pending(2, "h", 1, 10, 10, received=2.0),
               Pending(3, "g", 1, 10, 10, received=3.0, bulk=True)]
    batch = take_batch(backlog, limits, now=10.0, bulk_turn=True)
    assert [p.handle for p in batch] == [0, 1, 3]
    assert [p.handle for p in backlog] == [2]
