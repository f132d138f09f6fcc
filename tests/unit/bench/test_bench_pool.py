"""bench.pool: popularity, tiers, the split between workers, counters and the running order."""

from __future__ import annotations

import pytest

from bench.pool import (
    TIERS,
    counter_delta,
    log_events,
    make_plan,
    parse_counters,
    percentile,
    schedule,
    split_models,
    tier_of,
    tier_shares,
    zipf_weights,
)


def test_zipf_weights_sum_to_one_and_fall_as_one_over_k_to_the_s():
    weights = zipf_weights(12, 1.1)
    assert sum(weights) == pytest.approx(1.0)
    assert weights == sorted(weights, reverse=True)
    assert weights[0] / weights[1] == pytest.approx(2**1.1)
    assert zipf_weights(4, 0) == [0.25] * 4


@pytest.mark.parametrize(("n", "s"), [(0, 1.1), (3, -1.0), (3, float("inf"))])
def test_zipf_weights_refuse_nonsense(n, s):
    with pytest.raises(ValueError):
        zipf_weights(n, s)


def test_tiers_cover_the_twelve_ranks():
    assert [tier_of(rank) for rank in range(1, 13)] == (
        ["head"] * 2 + ["torso"] * 4 + ["tail"] * 6)
    with pytest.raises(ValueError):
        tier_of(13)
    shares = tier_shares(zipf_weights(12, 1.1))
    assert list(shares) == [t for t, _, _ in TIERS]
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["head"] == pytest.approx(0.52, abs=0.01)
    assert shares["tail"] == pytest.approx(0.19, abs=0.01)


def test_the_balanced_split_halves_the_traffic_and_the_contiguous_one_does_not():
    weights = zipf_weights(12, 1.1)
    first, second = split_models(weights)
    assert len(first) == len(second) == 6 and sorted(first + second) == list(range(12))
    # The most popular model shares its worker with the five least popular ones.
    assert first == [0, 7, 8, 9, 10, 11]
    assert sum(weights[i] for i in first) == pytest.approx(0.5, abs=0.01)
    first, second = split_models(weights, "contiguous")
    assert (first, second) == (list(range(6)), list(range(6, 12)))
    assert sum(weights[i] for i in first) > 0.8
    with pytest.raises(ValueError):
        split_models(weights[:11])
    with pytest.raises(ValueError):
        split_models(weights, "random")


def test_counter_deltas_from_two_scrapes():
    before = parse_counters(
        'shoal_model_loads_total{model="a",outcome="ok"} 2.0\n'
        'shoal_model_loads_total{model="b",outcome="does_not_fit"} 1.0\n'
        "shoal_resident_models 3.0\n", ["shoal_model_loads_total"])
    after = parse_counters(
        "# TYPE shoal_model_loads_total counter\n"
        'shoal_model_loads_total{model="a",outcome="ok"} 5.0\n'
        'shoal_model_loads_total{model="b",outcome="ok"} 1.0\n'
        'shoal_model_loads_total{model="b",outcome="does_not_fit"} 4.0\n'
        'shoal_model_evictions_total{model="a"} 7.0\n',
        ["shoal_model_loads_total", "shoal_model_evictions_total"])
    assert counter_delta(before, after, "shoal_model_loads_total", outcome="ok") == 4
    assert counter_delta(before, after, "shoal_model_loads_total") == 7
    assert counter_delta(before, after, "shoal_model_evictions_total") == 7
    assert counter_delta(before, after, "shoal_model_loads_total", model="b") == 4


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_every_round_runs_every_deployment_in_a_rotated_order():
    assert schedule(3, ["a", "b", "c"]) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
        (2, "c"), (2, "a"), (2, "b")]


def test_a_plan_is_fixed_by_its_seed_and_follows_the_popularity():
    weights = zipf_weights(12, 1.1)
    plan = make_plan(200.0, 10.0, weights, seed=3)
    assert plan == make_plan(200.0, 10.0, weights, seed=3)
    assert plan.offsets != make_plan(200.0, 10.0, weights, seed=4).offsets
    assert 1700 < len(plan.offsets) < 2300
    assert plan.offsets == sorted(plan.offsets) and plan.offsets[-1] < 10.0
    assert len(plan.ranks) == len(plan.texts) == len(plan.offsets)
    head = sum(1 for r in plan.ranks if r <= 2) / len(plan.ranks)
    assert head == pytest.approx(tier_shares(weights)["head"], abs=0.05)
    assert all(1 <= len(texts) <= 4 for texts in plan.texts)


def test_log_events_count_loads_and_evictions():
    log = "\n".join([
        "[2026-12-03 16:04:32,974: INFO/MainProcess] loading org/a",
        "[2026-12-03 16:04:34,978: INFO/MainProcess] loaded org/a (100.0 MiB) in 2.00s; "
        "400.0 of 410.0 MiB in use",
        "[2026-12-03 16:04:44,600: INFO/MainProcess] evicting org/a to make room for org/b",
        "[2026-12-03 16:04:44,604: INFO/MainProcess] loading org/b",
        "[2026-12-03 16:04:45,000: ERROR/MainProcess] org/b could not be loaded: boom",
    ])
    events = log_events(log)
    assert events["loads_started"] == 2 and events["evictions"] == 1
    assert events["loads_by_model"] == {"org/a": 1, "org/b": 1}
    assert events["evictions_by_model"] == {"org/a": 1}
    assert events["errors"] == 1 and events["tracebacks"] == 0
