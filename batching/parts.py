"""How many items of a request too big for one batch go in each of its parts.

A part must fit a batch (the item cap and the token budget) and should not
take longer than `target_s`: while it runs, every request that arrives waits
for it, so a part's time is what a big request adds to everyone else's
latency. Each part pays the batch's fixed cost again, so a part is allowed at
least `MIN_PART_OVERHEADS` times that cost (at most a fifth of a big
request's time goes to overheads, whatever the target): on a device with a
large fixed cost per batch, small parts would cost more than they save.
"""

from __future__ import annotations

import math

from batching.former import BatchLimits
from batching.latency_model import CostModel
from batching.shapes import BatchShape

MIN_PART_OVERHEADS = 4.0


def items_per_part(items: int, longest: int, cost: int, limits: BatchLimits,
                   cost_model: CostModel | None = None, target_s: float | None = None) -> int:
    """Items per part (at least 1; `items` when the request fits one batch and the target).

    Padded runtimes pay every item at the longest's length, so a part of `n`
    items costs n x longest; unpadded ones pay real tokens, taken as the
    request's mean item."""
    if items <= 1:
        return max(items, 1)
    per_item = longest if limits.padded else cost / items
    by_tokens = math.floor(limits.max_tokens / per_item) if per_item > 0 else items
    n = max(1, min(items, limits.max_items, by_tokens))
    if cost_model is None or target_s is None:
        return n
    target_s = max(target_s, MIN_PART_OVERHEADS * cost_model.coefficients[0])

    def predicted(k: int) -> float:
        return cost_model.predict(BatchShape(k, longest, round(k * cost / items)))

    low, high = 1, n  # predictions grow with the part: the largest within the target
    while low < high:
        mid = (low + high + 1) // 2
        if predicted(mid) > target_s:
            high = mid - 1
        else:
            low = mid
    return low
