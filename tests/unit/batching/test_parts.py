"""How big the parts of a request too big for one batch are."""

from __future__ import annotations

from batching.former import BatchLimits
from batching.latency_model import CostModel
from batching.parts import items_per_part

LIMITS = BatchLimits(max_tokens=4096, max_items=64)


def test_a_part_fits_the_token_budget_and_the_item_cap():
    assert items_per_part(512, 2000, 512 * 1500, LIMITS) == 2
    assert items_per_part(512, 10, 5120, LIMITS) == 64
    assert items_per_part(8, 10, 80, LIMITS) == 8  # fits whole
    # an item longer than the whole budget still runs, one per part
    assert items_per_part(3, 9000, 27000, LIMITS) == 1
    assert items_per_part(1, 9000, 9000, LIMITS) == 1


def test_unpadded_parts_count_real_tokens():
    limits = BatchLimits(max_tokens=4096, max_items=64, padded=False)
    assert items_per_part(100, 500, 10_000, limits) == 40


def test_a_part_takes_no_longer_than_the_target():
    model = CostModel(0.010, 1e-4, 0.0)  # 10 ms + 0.1 ms per padded token
    # 256-token items: 3 take 86.8 ms, 4 take 112.4 ms
    assert items_per_part(512, 256, 512 * 256, LIMITS, model, target_s=0.1) == 3
    # a single item over the target still runs (one per part)
    assert items_per_part(512, 256, 512 * 256, LIMITS, model, target_s=0.001) == 1
    # the budget still caps a generous target
    assert items_per_part(512, 256, 512 * 256, LIMITS, model, target_s=100.0) == 16


def test_a_part_pays_its_fixed_cost_at_most_a_fifth_of_the_time():
    model = CostModel(0.040, 1e-4, 0.0)  # 40 ms a batch: parts of at least 160 ms
    # 256-token items: 4 take 142 ms, 5 take 168 ms; a 100 ms target would allow 2
    assert items_per_part(512, 256, 512 * 256, LIMITS, model, target_s=0.1) == 4
