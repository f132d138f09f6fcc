"""The fleet's plan as a pure function of its picture (batching.fleet)."""

from __future__ import annotations

import pytest

from batching.fleet import (
    HELD_BONUS,
    TARGET_BUSY,
    DecayingRate,
    Demand,
    WorkerView,
    copies_wanted,
    fleet_demand,
    plan_fleet,
)

MIB = 2**20
MODELS = [f"m{i:02d}" for i in range(1, 13)]  # m01 the most asked for


def zipf(n: int = 12, total: float = 70.0) -> dict[str, Demand]:
    raw = [1 / k**1.1 for k in range(1, n + 1)]
    return {m: Demand(rate=total * r / sum(raw), busy=0.3 * r / sum(raw), bytes=100 * MIB,
                      load_s=2.0) for m, r in zip(MODELS[:n], raw, strict=True)}


def worker(name: str, slots: int, held=(), pinned=(), serves=MODELS) -> WorkerView:
    return WorkerView(name, slots * 100 * MIB + 10 * MIB, frozenset(serves), frozenset(held),
                      frozenset(pinned))


def test_copies_grow_with_the_device_time_the_traffic_takes():
    assert copies_wanted(0.0, 4) == 1
    assert copies_wanted(TARGET_BUSY * 0.99, 4) == 1
    assert copies_wanted(TARGET_BUSY * 1.01, 4) == 2  # before the holder saturates
    assert copies_wanted(10.0, 3) == 3  # never more than the workers that serve it
    assert copies_wanted(1.0, 0) == 0


def test_when_everything_fits_each_model_has_one_copy_and_no_swap():
    plan = plan_fleet([worker("a", 6), worker("b", 6)], zipf())
    assert sorted(plan.keep["a"] | plan.keep["b"]) == MODELS
    assert not plan.keep["a"] & plan.keep["b"]  # no model held twice
    assert plan.swap == {}
    assert len(plan.keep["a"]) == len(plan.keep["b"]) == 6


def test_the_work_is_balanced_between_the_workers():
    demand = zipf()
    plan = plan_fleet([worker("a", 6), worker("b", 6)], demand)
    share = [sum(demand[m].rate for m in plan.keep[w]) for w in "ab"]
    assert max(share) / sum(share) < 0.6


def test_when_it_does_not_fit_the_hot_models_are_kept_and_the_rest_swapped_in_one_each():
    plan = plan_fleet([worker("a", 4), worker("b", 4)], zipf())
    kept = plan.keep["a"] | plan.keep["b"]
    assert kept == set(MODELS[:6])  # one slot per worker stays free for the swapped ones
    assert set(plan.swap) == set(MODELS[6:])
    assert set(plan.swap.values()) == {"a", "b"}  # both swap, each model on one only
    for model in MODELS:  # every model is served by exactly one worker
        assert sum(model in plan.serves(w) for w in "ab") == 1


def test_a_hot_model_gets_a_second_copy_before_its_holder_saturates():
    demand = zipf()
    demand["m01"] = Demand(rate=60, busy=TARGET_BUSY * 1.5, bytes=100 * MIB, load_s=2.0)
    plan = plan_fleet([worker("a", 7), worker("b", 7)], demand)  # room to spare
    assert plan.holders("m01") == ["a", "b"]
    assert plan.copies["m01"] == 2


def test_a_rare_model_is_held_by_one_worker_and_a_second_worker_does_not_load_it():
    demand = zipf()
    plan = plan_fleet([worker("a", 6, held=["m12"]), worker("b", 6)], demand)
    assert plan.holders("m12") == ["a"]
    assert "m12" not in plan.serves("b")


def test_a_model_stays_where_it_is_held():
    demand = zipf()
    first = plan_fleet([worker("a", 6), worker("b", 6)], demand)
    held = {w: first.keep[w] for w in "ab"}
    # the other way round from what the plan would choose alone: the plan keeps it so
    swapped = plan_fleet([worker("a", 6, held=held["b"]), worker("b", 6, held=held["a"])],
                         demand)
    assert swapped.keep["a"] == held["b"] and swapped.keep["b"] == held["a"]


def test_hysteresis_a_held_model_is_not_displaced_by_one_slightly_more_asked_for():
    demand = zipf()
    # m06 (kept) and m07 (swapped): m07 becomes a little more popular than m06
    demand["m07"] = Demand(rate=demand["m06"].rate * (1 + HELD_BONUS / 2), busy=0.01,
                           bytes=100 * MIB, load_s=2.0)
    first = plan_fleet([worker("a", 4), worker("b", 4)], zipf())
    held = {w: first.keep[w] for w in "ab"}
    views = [worker("a", 4, held=held["a"]), worker("b", 4, held=held["b"])]
    plan = plan_fleet(views, demand)
    assert "m06" in plan.keep["a"] | plan.keep["b"]
    assert "m07" in plan.swap
    # ... but by much more, it is
    demand["m07"] = Demand(rate=demand["m06"].rate * (1 + HELD_BONUS * 2), busy=0.01,
                           bytes=100 * MIB, load_s=2.0)
    plan = plan_fleet(views, demand)
    assert "m07" in plan.keep["a"] | plan.keep["b"]
    assert "m06" in plan.swap


def test_pinned_models_stay_and_count_against_their_workers_budget():
    plan = plan_fleet([worker("a", 4, held=["m12"], pinned=["m12"]), worker("b", 4)], zipf())
    assert "m12" in plan.keep["a"]
    assert "m12" not in plan.swap
    assert len(plan.keep["a"]) == 3  # 4 slots: the pin, 2 more, the swap room


def test_a_model_only_some_workers_serve_goes_to_one_of_them():
    plan = plan_fleet([worker("a", 6, serves=MODELS[:6]), worker("b", 6)], zipf())
    for model in MODELS[6:]:
        assert model in plan.keep["b"]


def test_every_worker_computes_the_same_plan_whatever_the_order_it_lists_them_in():
    views = [worker("a", 4, held=["m03"]), worker("b", 4), worker("c", 3)]
    assert plan_fleet(views, zipf()) == plan_fleet(list(reversed(views)), zipf())


def test_no_two_workers_are_told_to_load_a_cold_model():
    plan = plan_fleet([worker(w, 4) for w in "abcd"], {})  # nothing asked for yet
    for model in MODELS:
        assert sum(model in plan.serves(w) for w in "abcd") == 1


def test_the_fleets_demand_sums_the_workers_reports():
    demand = fleet_demand([{"x": {"rate": 2.0, "busy": 0.1}}, {"x": {"rate": 3.0}}],
                          {"x": 5}, {"x": 0.5})
    assert demand["x"] == Demand(5.0, 0.1, 5, 0.5)


def test_a_decaying_rate_follows_a_step_and_forgets():
    rate = DecayingRate(10.0)
    for i in range(1000):  # 10 per second for 100 s
        rate.add(i / 10)
    assert rate.rate(100.0) == pytest.approx(10.0, rel=0.05)
    assert rate.rate(130.0) < 1.0  # three windows of silence
    with pytest.raises(ValueError):
        DecayingRate(0)


def test_a_swapped_model_goes_back_to_the_worker_that_held_it_last():
    model = "m07"  # the most asked for of the swapped ones: placed first
    for warm_on in "ab":
        views = [WorkerView(w, 410 * MIB, frozenset(MODELS),
                            warm=frozenset([model]) if w == warm_on else frozenset())
                 for w in "ab"]
        assert plan_fleet(views, zipf()).swap[model] == warm_on


def test_a_held_model_moves_off_a_worker_it_would_keep_too_busy():
    demand = {m: Demand(rate=r, busy=b, bytes=100 * MIB, load_s=2.0)
              for m, r, b in (("m01", 24, 0.45), ("m02", 11, 0.25), ("m03", 7, 0.1))}
    views = [WorkerView("a", 410 * MIB, frozenset(demand), frozenset(demand)),
             WorkerView("b", 410 * MIB, frozenset(demand))]
    plan = plan_fleet(views, demand)
    # a holds all three, but m01 and m02 together would keep its device 70% busy
    assert "m01" in plan.keep["a"] and "m02" in plan.keep["b"]
    # ... and where no other worker has room to spare, it stays
    full = [views[0], WorkerView("b", 50 * MIB, frozenset(demand))]
    assert plan_fleet(full, demand).keep["a"] >= {"m01", "m02"}


def test_the_swapped_models_are_shared_even_when_one_worker_held_them_all():
    # a worker that loaded every model once (a warm-up) does not keep all the swapping
    views = [WorkerView("a", 410 * MIB, frozenset(MODELS)),
             WorkerView("b", 410 * MIB, frozenset(MODELS), warm=frozenset(MODELS))]
    plan = plan_fleet(views, zipf())
    swapped = [plan.swap[m] for m in MODELS[6:]]
    assert swapped.count("a") == swapped.count("b") == 3


def test_an_extra_copy_never_pushes_a_models_only_copy_out():
    demand = zipf()
    demand["m01"] = Demand(rate=60, busy=TARGET_BUSY * 1.5, bytes=100 * MIB, load_s=2.0)
    plan = plan_fleet([worker("a", 6), worker("b", 6)], demand)  # 12 slots, 12 models
    assert plan.swap == {}
    assert plan.holders("m01") == ["a"] or plan.holders("m01") == ["b"]


def test_a_second_copy_held_stays_while_its_traffic_hovers_at_the_threshold():
    demand = zipf()
    demand["m01"] = Demand(rate=60, busy=TARGET_BUSY * 0.9, bytes=100 * MIB, load_s=2.0)
    views = [worker("a", 8, held=["m01"]), worker("b", 8, held=["m01"])]
    assert plan_fleet(views, demand).holders("m01") == ["a", "b"]
    demand["m01"] = Demand(rate=60, busy=TARGET_BUSY * 0.5, bytes=100 * MIB, load_s=2.0)
    assert len(plan_fleet(views, demand).holders("m01")) == 1


def test_held_models_are_moved_to_balance_the_device_time():
    # one worker holds ranks 1-3 (a warm-up's luck): 0.35 + 0.17 + 0.11 of a device
    demand = zipf()
    for m, busy in (("m01", 0.35), ("m02", 0.17), ("m03", 0.11)):
        demand[m] = Demand(demand[m].rate, busy, 100 * MIB, 2.0)
    views = [worker("a", 4, held=["m01", "m02", "m03"]), worker("b", 4)]
    plan = plan_fleet(views, demand)
    busy = {w: sum(demand[m].busy for m in plan.keep[w]) for w in "ab"}
    assert "m01" in plan.keep["a"]  # the biggest stays where it is
    assert max(busy.values()) < 0.45 and min(busy.values()) > 0.25, busy
    # and once moved, they stay
    moved = [worker(w, 4, held=plan.keep[w]) for w in "ab"]
    assert plan_fleet(moved, demand).keep == plan.keep
