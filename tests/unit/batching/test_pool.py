"""The device memory pool's bookkeeping: admission, LRU eviction, what is never evicted."""

from __future__ import annotations

import pytest

from batching.pool import DoesNotFit, Pool, lora_key

MB = 2**20


def _resident(pool: Pool, key: str, size: int, at: float, pinned: bool = False) -> None:
    pool.admit(key, size, at, pinned=pinned)
    pool.loaded(key, size, at)


def test_a_load_that_fits_evicts_nothing():
    pool = Pool(300 * MB)
    _resident(pool, "a", 100 * MB, 1)
    assert pool.admit("b", 100 * MB, 2) == []
    assert pool.loading("b") and pool.used() == 200 * MB


def test_the_third_model_evicts_the_least_recently_used():
    pool = Pool(250 * MB)  # fits two of three
    _resident(pool, "a", 100 * MB, 1)
    _resident(pool, "b", 100 * MB, 2)
    pool.touch("a", 3)  # a was used after b
    assert pool.admit("c", 100 * MB, 4) == ["b"]
    assert set(pool.slots) == {"a", "c"}


def test_only_as_many_as_needed_go():
    pool = Pool(400 * MB)
    for i, key in enumerate("abc"):
        _resident(pool, key, 100 * MB, i)
    assert pool.admit("d", 150 * MB, 9) == ["a"]


def test_pinned_models_are_never_evicted():
    pool = Pool(250 * MB)
    _resident(pool, "pinned", 100 * MB, 0, pinned=True)
    _resident(pool, "b", 100 * MB, 5)
    assert pool.admit("c", 100 * MB, 9) == ["b"]


def test_models_in_use_or_loading_are_not_evicted():
    pool = Pool(250 * MB)
    _resident(pool, "busy", 100 * MB, 0)
    pool.admit("loading", 100 * MB, 1)
    with pytest.raises(DoesNotFit, match="busy"):
        pool.admit("c", 100 * MB, 9, in_use={"busy"})
    assert set(pool.slots) == {"busy", "loading"}  # nothing changed


def test_a_model_bigger_than_everything_evictable_is_refused_without_evicting():
    pool = Pool(300 * MB)
    _resident(pool, "pinned", 100 * MB, 0, pinned=True)
    _resident(pool, "b", 100 * MB, 1)
    with pytest.raises(DoesNotFit, match=r"needs about 250\.0 MiB"):
        pool.admit("huge", 250 * MB, 9)
    assert set(pool.slots) == {"pinned", "b"}


def test_a_failed_load_releases_its_reservation():
    pool = Pool(100 * MB)
    pool.admit("a", 80 * MB, 0)
    pool.failed("a")
    assert pool.used() == 0 and pool.admit("b", 100 * MB, 1) == []


def test_a_measured_footprint_replaces_the_estimate():
    pool = Pool(100 * MB)
    pool.admit("a", 80 * MB, 0)
    pool.loaded("a", 30 * MB, 1)
    assert pool.used() == 30 * MB and pool.resident("a")


def test_an_evicted_model_takes_its_lora_adapters_and_an_adapter_in_use_keeps_its_base():
    pool = Pool(300 * MB)
    _resident(pool, "base", 100 * MB, 0)
    pool.admit(lora_key("base", "x"), 10 * MB, 1, base="base")
    pool.loaded(lora_key("base", "x"), 10 * MB, 1)
    _resident(pool, "other", 100 * MB, 2)
    with pytest.raises(DoesNotFit):  # base is older, but its adapter is in use
        pool.admit("big", 200 * MB, 3, in_use={lora_key("base", "x")})
    assert pool.admit("big", 150 * MB, 3) == ["base", lora_key("base", "x")]
