"""The host-memory tier's bookkeeping (issue 51): least recently kept first, never more
than the budget, nothing kept when off or too large."""

from __future__ import annotations

import pytest

from runtimes.child_side.host_tier import HostTier


def test_keeps_and_gives_back_once():
    tier: HostTier[str] = HostTier(100)
    assert tier.put("a", "A", 40) == []
    assert "a" in tier and tier.used == 40 and tier.bytes_of("a") == 40
    assert tier.take("a") == "A"
    assert tier.take("a") is None
    assert (tier.hits, tier.misses, tier.kept, tier.used, len(tier)) == (1, 1, 1, 0, 0)


def test_evicts_the_least_recently_kept_until_the_new_one_fits():
    tier: HostTier[str] = HostTier(100)
    tier.put("a", "A", 40)
    tier.put("b", "B", 40)
    tier.put("c", "C", 10)
    assert tier.put("d", "D", 70) == [("a", "A"), ("b", "B")]  # 50 + 70 > 100: b goes too
    assert tier.keys() == ["c", "d"] and tier.used == 80 and tier.evicted == 2


def test_taking_one_makes_room_and_a_put_again_is_the_newest():
    tier: HostTier[str] = HostTier(100)
    tier.put("a", "A", 50)
    tier.put("b", "B", 50)
    assert tier.take("a") == "A"
    tier.put("a", "A2", 50)  # back after a reload and another unload: newest now
    assert tier.put("c", "C", 50) == [("b", "B")]
    assert tier.keys() == ["a", "c"]


def test_a_put_under_a_kept_key_replaces_it():
    tier: HostTier[str] = HostTier(100)
    tier.put("a", "A", 60)
    assert tier.put("a", "A2", 70) == [("a", "A")]
    assert tier.used == 70 and tier.take("a") == "A2"


def test_one_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    tier: HostTier[str] = HostTier(100)
    tier.put("a", "A", 60)
    assert tier.put("big", "BIG", 101) == [("big", "BIG")]
    assert tier.keys() == ["a"] and tier.used == 60 and tier.refused == 1
    assert tier.put("exact", "E", 100) == [("a", "A")]  # the whole budget is allowed
    assert tier.used == 100


def test_a_budget_of_zero_keeps_nothing():
    tier: HostTier[str] = HostTier(0)
    assert not tier.on and not tier.fits(0)
    assert tier.put("a", "A", 1) == [("a", "A")]
    assert tier.take("a") is None and len(tier) == 0
    assert tier.misses == 0  # an off tier counts no misses


def test_never_more_than_the_budget():
    tier: HostTier[int] = HostTier(1000)
    for n in range(200):
        tier.put(f"m{n % 17}", n, (n * 37) % 400 + 1)
        assert tier.used <= tier.budget
        assert tier.used == sum(tier.bytes_of(k) or 0 for k in tier)


def test_discard_and_clear_count_nothing():
    tier: HostTier[str] = HostTier(100)
    tier.put("a", "A", 10)
    tier.put("b", "B", 10)
    assert tier.discard("a") == "A" and tier.discard("a") is None
    assert tier.clear() == [("b", "B")]
    assert (tier.hits, tier.misses, tier.used) == (0, 0, 0)


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError):
        HostTier(-1)
