"""bench.pool's scenarios, pure parts: the mux router, the rotation and the burst, p99 over
time and the recovery after a rotation, ratios against the better router."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.pool import parser, scaling
from bench.pool_fleet import MIB, deployments
from bench.pool_mux import MuxRouter
from bench.pool_scenarios import SCENARIOS, plans_for, resolve
from bench.pool_stats import bucket_p99, burst_stats, ratios, recovery_s, rotation_stats
from bench.pool_traffic import (
    Burst,
    Rotation,
    make_plan,
    middle_burst,
    split_models,
    tier_shares,
    zipf_weights,
)

# --- the mux router ----------------------------------------------------------------------


def test_mux_sends_a_new_model_to_the_least_busy_replica_and_then_keeps_it_there():
    router = MuxRouter(replicas=2, slots=2)
    assert router.choose("a") == 0  # nobody holds it; all idle: the lowest index
    assert router.choose("b") == 1  # replica 0 has one outstanding
    assert router.choose("a") == 0  # replica 0 holds a, though it is the busier
    assert router.outstanding == [2, 1]
    router.done(0)
    router.done(0)
    assert router.choose("c") == 0  # nobody holds c: the least busy
    assert router.holders("a") == [0] and router.holders("c") == [0]


def test_mux_prefers_the_least_busy_holder():
    router = MuxRouter(replicas=3, slots=4)
    for replica in range(3):
        router.held[replica]["a"] = None
    router.outstanding = [3, 1, 2]
    assert router.choose("a") == 1
    assert router.outstanding == [3, 2, 2]


def test_mux_mirrors_each_replicas_lru_eviction():
    router = MuxRouter(replicas=1, slots=2)
    for model in ("a", "b", "a", "c"):  # a was used after b: b is the one evicted
        router.done(router.choose(model))
    assert list(router.held[0]) == ["a", "c"]
    assert router.holders("b") == []
    assert router.outstanding == [0]


def test_mux_refuses_nonsense():
    with pytest.raises(ValueError):
        MuxRouter(0, 2)
    with pytest.raises(ValueError):
        MuxRouter(2, 2).done(1)


# --- traffic that moves --------------------------------------------------------------------


def test_a_rotation_moves_each_ranks_traffic_by_its_step():
    rotation = Rotation(first=10.0, every=60.0, step=4)
    assert [rotation.count(t) for t in (0, 9.9, 10, 69.9, 70, 130)] == [0, 0, 1, 1, 2, 3]
    assert rotation.model(1, 5.0, 12) == 0
    assert rotation.model(1, 10.0, 12) == 4  # the model that was rank 5
    assert rotation.model(12, 10.0, 12) == 3  # wraps around
    assert rotation.model(1, 130.0, 12) == 0  # three rotations of 4: back to the start
    assert rotation.times(190.0) == [10.0, 70.0, 130.0]
    with pytest.raises(ValueError):
        Rotation(0.0, 0.0, 1)


def test_a_plan_with_a_rotation_keeps_its_arrivals_and_moves_its_models():
    weights = zipf_weights(12, 1.1)
    plain = make_plan(50.0, 20.0, weights, seed=2)
    rotated = make_plan(50.0, 20.0, weights, seed=2, rotation=Rotation(10.0, 100.0, 4))
    assert rotated.offsets == plain.offsets and rotated.ranks == plain.ranks
    for i, offset in enumerate(rotated.offsets):
        shift = 4 if offset >= 10.0 else 0
        assert rotated.model(i) == (rotated.ranks[i] - 1 + shift) % 12
    assert plain.model(0) == plain.ranks[0] - 1


def test_a_burst_adds_arrivals_of_its_model_only_inside_it():
    weights = zipf_weights(12, 1.1)
    plain = make_plan(30.0, 40.0, weights, seed=5)
    burst = middle_burst(12, 20.0, 10.0, warmup=5.0, duration=30.0)
    assert (burst.start, burst.end) == (15.0, 25.0)
    plan = make_plan(30.0, 40.0, weights, seed=5, burst=burst)
    extra = [i for i in range(len(plan.offsets)) if plan.is_burst(i)]
    assert 120 < len(extra) < 280
    assert all(plan.ranks[i] == 12 and burst.during(plan.offsets[i]) for i in extra)
    steady = [o for i, o in enumerate(plan.offsets) if not plan.is_burst(i)]
    assert steady == plain.offsets and plan.offsets == sorted(plan.offsets)
    with pytest.raises(ValueError):
        middle_burst(12, 20.0, 30.0, warmup=5.0, duration=30.0)


# --- over time ----------------------------------------------------------------------------


def test_buckets_hold_the_points_of_their_interval():
    points = [(0.5, 10.0), (4.9, 20.0), (5.0, 30.0), (12.0, 40.0), (15.0, 99.0)]
    buckets = bucket_p99(points, 0.0, 15.0, 5.0)
    assert [b["t"] for b in buckets] == [0.0, 5.0, 10.0]
    assert [b["n"] for b in buckets] == [2, 1, 1]
    assert buckets[1]["p99_ms"] == 30.0 and buckets[2]["p99_ms"] == 40.0
    assert [b["n"] for b in bucket_p99(points, 0.0, 14.0, 5.0)] == [2, 1, 1]
    assert bucket_p99([], 0.0, 10.0, 5.0)[0]["p99_ms"] is None
    with pytest.raises(ValueError):
        bucket_p99(points, 0.0, 10.0, 0.0)


def _series(*p99s):
    return [{"t": 5.0 * k, "n": 1, "p99_ms": v} for k, v in enumerate(p99s)]


def test_recovery_is_when_p99_is_back_within_the_factor_for_good():
    assert recovery_s(_series(100, 120, 140), steady_ms=100) == 0.0
    assert recovery_s(_series(900, 400, 140, 120), steady_ms=100) == 10.0
    # Back, then out again: it counts from the last time it came back.
    assert recovery_s(_series(900, 100, 900, 140, 100), steady_ms=100) == 15.0
    assert recovery_s(_series(900, 100, 900), steady_ms=100) is None
    # Empty buckets say nothing.
    assert recovery_s(_series(900, None, 100, None), steady_ms=100) == 10.0
    assert recovery_s(_series(100), steady_ms=None) is None
    assert recovery_s(_series(190, 210), steady_ms=100, factor=2.0) is None


def _outcome(sent, latency_ms, rank=1, ok=True, burst=False):
    return SimpleNamespace(sent=sent, done=sent + latency_ms / 1000, ok=ok, rank=rank,
                           burst=burst)


def test_rotation_stats_compare_each_rotation_with_the_half_period_before_it():
    # Window 0..30 s, a rotation at 10 and 20; 10 ms steady, 1 s for 3 s after each.
    outcomes = [_outcome(t / 10, 1000 if 10 <= t / 10 < 13 or 20 <= t / 10 < 23 else 10)
                for t in range(300)]
    stats = rotation_stats(outcomes, 0.0, (0.0, 30.0), [10.0, 20.0, 40.0], width=1.0)
    assert len(stats["buckets"]) == 30
    first, second = stats["rotations"]
    assert first["at"] == 10.0 and second["at"] == 20.0
    assert first["steady_p99_ms"] == pytest.approx(10.0)
    assert first["worst_p99_ms"] == pytest.approx(1000.0)
    assert first["recovery_s"] == 3.0 and second["recovery_s"] == 3.0
    assert len(first["buckets"]) == 10


def test_burst_stats_split_the_head_by_the_burst_and_keep_its_requests_apart():
    burst = Burst(rank=12, rate=20.0, start=10.0, seconds=5.0)
    outcomes = [_outcome(t, 50) for t in (1, 2, 3)] + [_outcome(t, 500) for t in (11, 12)]
    outcomes += [_outcome(12.5, 3000, rank=12, burst=True),
                 _outcome(13.0, 0, rank=12, ok=False, burst=True),
                 _outcome(11.0, 9999, rank=5)]
    stats = burst_stats(outcomes, 0.0, burst)
    assert stats["head_p99_during_ms"] == pytest.approx(500.0)
    assert stats["head_p99_outside_ms"] == pytest.approx(50.0)
    assert stats["p50_ms"] == pytest.approx(3000.0) and stats["errors"] == 1
    assert stats["error_rate"] == 0.5


# --- over rounds ---------------------------------------------------------------------------


def _row(name, rnd, head, torso, tail):
    return {"deployment": name, "round": rnd,
            **{t: {"p99_ms": v} for t, v in (("head", head), ("torso", torso), ("tail", tail))}}


def test_the_pool_is_compared_with_the_better_router_of_each_round():
    rows = [_row("pool", 1, 100, 100, 100), _row("router", 1, 50, 400, 400),
            _row("mux", 1, 200, 200, None), _row("pool", 2, 100, 100, 100),
            _row("mux", 2, 400, 50, 25)]
    out = ratios(rows, ("router", "mux", "mux-host"), ("pool", "pool-lru"))
    assert list(out) == ["pool"]
    assert out["pool"]["head"]["rounds"] == [2.0, 0.25]
    assert out["pool"]["head"]["against"] == ["router", "mux"]
    assert out["pool"]["torso"]["rounds"] == [0.5, 2.0]
    assert out["pool"]["tail"]["rounds"] == [0.25, 4.0]
    assert out["pool"]["tail"]["median"] == pytest.approx(2.125)


def test_scaling_sets_each_runs_efficiency_against_ref_1_of_its_round():
    def row(name, n, rps, util=0.95, machine=0.5):
        return {"deployment": name, "round": 1, "workers": n, "req_per_s": rps,
                "offered_per_s": 12.0 * n, "client_sent_per_s": 12.0 * n,
                "send_lag_p99_ms": 5.0, "utilisation_mean": util,
                "cpu": {"machine": machine, "client_cores": 0.2}}
    rows = [row("ref-1", 1, 10.0), row("pool-8", 8, 76.0, machine=0.95),
            row("pool-4", 4, 20.0, util=0.4), row("pool-2", 2, 24.0, util=0.4)]
    assert scaling(rows) == 10.0
    assert rows[1]["efficiency"] == pytest.approx(0.95)
    assert rows[1]["limit"] == "machine CPU"
    assert rows[2]["limit"].endswith("placement)") and rows[0]["limit"].startswith("fleet")
    assert rows[3]["limit"] == "not saturated"


# --- the scenarios -------------------------------------------------------------------------


def test_each_scenario_picks_its_deployments_and_defaults():
    args = resolve(parser().parse_args(["--scenario", "fits"]))
    assert args.slots == 6 and args.deployments == list(SCENARIOS["fits"]["deployments"])
    args = resolve(parser().parse_args(["--scenario", "shift", "--shift-s", "20"]))
    assert args.duration == 60.0 and args.slots == 4
    args = resolve(parser().parse_args(["--scenario", "workers", "--workers", "1,2"]))
    assert args.deployments == ["ref-1", "pool-1", "pool-2"] and args.sim_speed == 0.1
    args = resolve(parser().parse_args(["--deployments", "mux,pool"]))
    assert args.deployments == ["mux", "pool"] and args.scenario == "thrash"


def test_deployments_set_placement_host_tier_and_queues():
    models = [f"m{i}" for i in range(12)]
    halves = split_models(zipf_weights(12, 1.1))
    plans = deployments(models, halves, 100 * MIB, 4, 6, workers=3)
    assert all(w.placement == "fleet" and w.host_bytes >= 12 * 100 * MIB
               for w in plans["pool"].workers)
    assert len(plans["pool"].workers) == len(plans["mux"].workers) == 3
    for name in ("pool-lru", "mux", "router", "partition"):
        assert all(w.host_bytes == 0 and w.placement == "lru" for w in plans[name].workers)
    assert plans["mux"].own_queues and plans["mux-host"].own_queues
    assert plans["mux"].slots == 4 and not plans["pool"].own_queues
    assert all(w.host_bytes > 0 for w in plans["mux-host"].workers)
    assert all(w.budget_bytes == 4 * 100 * MIB + 10 * MIB for w in plans["mux"].workers)


def test_the_workers_scenario_scales_the_rate_with_the_fleet():
    args = resolve(parser().parse_args(["--scenario", "workers", "--workers", "1,4",
                                        "--per-worker-rate", "10"]))
    models = [f"m{i}" for i in range(12)]
    plans = plans_for(args, models, split_models(zipf_weights(12, 1.1)), 100 * MIB)
    ref, ref_rate = plans["ref-1"]
    assert ref_rate == 10.0 and len(ref.workers) == 1
    assert ref.workers[0].budget_bytes >= 12 * 100 * MIB
    four, rate = plans["pool-4"]
    assert rate == 40.0 and len(four.workers) == 4
    assert tier_shares(zipf_weights(12, 1.1))["head"] > 0.5
