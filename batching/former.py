"""The batch former: picks the next batch from a worker's backlog.

Rules (first version; the cost model and overflow return build on these):
- the oldest request is always in the next batch, so nothing starves;
- only requests of the same group (operation, LoRA, ...) run together;
- further requests join in arrival order while the batch stays within the
  padded-token budget (items x longest item) and the item cap;
- a request bigger than the whole budget still runs, alone;
- an idle runtime starts at once; waiting up to `max_delay_s` for a fuller
  batch happens only under load (the runtime was busy a moment ago).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Pending:
    """A request held by the worker, described by its annotations only."""

    handle: Any  # opaque to the former: the worker's message
    group: Hashable
    items: int
    cost: int  # estimated real tokens of the request
    longest: int  # estimated tokens of its longest item
    received: float  # seconds, same clock as `now`


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_tokens: int  # padded tokens: items x longest item
    max_items: int
    max_delay_s: float = 0.0


def padded_tokens(items: int, longest: int) -> int:
    return items * longest


def take_batch(backlog: list[Pending], limits: BatchLimits) -> list[Pending]:
    """Remove and return the next batch from `backlog` (kept in arrival order)."""
    if not backlog:
        return []
    first = backlog[0]
    chosen = [first]
    items, longest = first.items, first.longest
    for pending in backlog[1:]:
        if pending.group != first.group:
            continue
        new_items = items + pending.items
        new_longest = max(longest, pending.longest)
        if new_items > limits.max_items:
            continue
        if padded_tokens(new_items, new_longest) > limits.max_tokens:
            continue
        chosen.append(pending)
        items, longest = new_items, new_longest
        if items >= limits.max_items:
            break
    taken = {id(p) for p in chosen}
    backlog[:] = [p for p in backlog if id(p) not in taken]
    return chosen


def is_full(batch: Iterable[Pending], limits: BatchLimits) -> bool:
    """Whether a batch has used at least half of its item or token budget."""
    items = longest = 0
    for p in batch:
        items += p.items
        longest = max(longest, p.longest)
    return items * 2 >= limits.max_items or padded_tokens(items, longest) * 2 >= limits.max_tokens


def seconds_to_wait(
    backlog: list[Pending], limits: BatchLimits, now: float, busy_until: float | None
) -> float:
    """How long an idle runtime should wait before taking the next batch.

    `busy_until` is when the runtime last finished a batch (None if never).
    Zero means start now: the backlog is empty of reasons to wait, the
    runtime has been idle longer than the delay (no load), or the oldest
    request has already waited the whole delay.
    """
    if not backlog or limits.max_delay_s <= 0:
        return 0.0
    if busy_until is None or now - busy_until >= limits.max_delay_s:
        return 0.0
    if is_full(backlog, limits):
        return 0.0
    oldest_wait = now - backlog[0].received
    return max(0.0, limits.max_delay_s - oldest_wait)
