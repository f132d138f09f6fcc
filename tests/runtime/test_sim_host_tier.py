"""The simulated runtime's host-memory tier (issue 51): a model unloaded while the host
budget allows loads again in its profile's host_load_ms, not its load_ms."""

from __future__ import annotations

import time

from runtimes.doubles.sim import SimRuntime
from tasks.catalog import ModelEntry

MiB = 2**20


def entry(model: str, **profile: float) -> ModelEntry:
    return ModelEntry.model_validate({
        "id": model, "adapter": "dense", "dims": 8, "source": {"hub": "x/y"},
        "profiles": {"cpu": {"footprint_bytes": 100 * MiB, **profile}}})


SLOW = entry("t/slow", load_ms=300, host_load_ms=10)
DEFAULT = entry("t/default", load_ms=300)  # host_load_ms unset: a tenth, 30 ms
OTHER = entry("t/other", load_ms=300, host_load_ms=10)


def timed_load(sim: SimRuntime, model: str) -> float:
    started = time.perf_counter()
    assert sim.load(model) == 100 * MiB
    return time.perf_counter() - started


def test_a_reload_from_host_memory_is_the_short_one():
    sim = SimRuntime([SLOW, DEFAULT], "cpu", loaded=[], host_bytes=1024 * MiB)
    for model in (SLOW.id, DEFAULT.id):
        first = timed_load(sim, model)
        sim.unload(model)
        assert model in sim.tier and model not in sim.resident
        again = timed_load(sim, model)
        assert first >= 0.3 and again < first / 2, (model, first, again)
        assert model not in sim.tier and model in sim.resident
    assert sim.tier.hits == 2


def test_without_a_tier_or_room_a_reload_takes_the_whole_load():
    for budget in (0, 50 * MiB):  # off; smaller than the model
        sim = SimRuntime([SLOW], "cpu", loaded=[SLOW.id], host_bytes=budget)
        sim.unload(SLOW.id)
        assert len(sim.tier) == 0
        assert timed_load(sim, SLOW.id) >= 0.3


def test_the_least_recently_unloaded_leaves_the_tier_first():
    sim = SimRuntime([SLOW, OTHER], "cpu", host_bytes=150 * MiB)  # room for one
    sim.unload(SLOW.id)
    sim.unload(OTHER.id)
    assert sim.tier.keys() == [OTHER.id] and sim.tier.used == 100 * MiB
    assert timed_load(sim, OTHER.id) < 0.15
    assert timed_load(sim, SLOW.id) >= 0.3
