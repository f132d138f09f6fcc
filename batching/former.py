"""The batch former: picks the next batch from a worker's backlog.

Rules:
- the oldest request a caller waits for leads the next batch, so nothing starves; a
  bulk job's part (`Pending.bulk`) leads only when no such request is held, or when
  it is the parts' turn (the scheduler gives them one every `bulk_pass_s` at least);
  a batch led by a waited-for request takes no job part (a part would make it longer);
- only requests of the same group (operation, options that change the
  forward pass, LoRA) run together;
- requests of that group older than `max_wait_s` join first, oldest first:
  they are due and must not keep losing their place to better-fitting ones;
- the rest of the batch is filled with the requests whose longest item is
  closest to the batch's current longest item, which cuts the padding a
  padded runtime pays (items x longest) compared with arrival order;
- a batch never exceeds the token budget or the item cap, nor (given a cost
  model and a latency target) the predicted-latency target;
- a request bigger than the whole budget still runs, alone;
- two requests with the same `key` (id) never share a batch: the second waits for the
  next one (the runtime answers a batch by id);
- an idle runtime starts at once; waiting up to `max_delay_s` for a fuller
  batch happens only under load (the runtime was busy a moment ago).

The backlog is kept in arrival order (`received` never decreases along it):
"oldest" and "older" below mean "earlier in the backlog".
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from batching.latency_model import CostModel
from batching.shapes import BatchShape, Pending, batch_tokens, padded_tokens


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_tokens: int  # token budget per batch (padded tokens when `padded`)
    max_items: int
    max_delay_s: float = 0.0
    max_wait_s: float = 0.5  # a request older than this goes into the very next batch
    padded: bool = True  # padded runtimes pay items x longest; unpadded pay real tokens
    latency_target_s: float | None = None  # a batch predicted slower is not grown further
    # Job parts passed over for requests callers wait for lead a batch at least this often.
    bulk_pass_s: float = 1.0
    # While callers wait too, a job's part runs in pieces predicted at most this long: a
    # caller's request then waits at most about this behind one
    # (app.worker.lifecycle.splits.split_request).
    bulk_slice_s: float = 0.05


@dataclass(slots=True)
class _Forming:
    """A batch being formed, with running totals so each fit check is O(1)."""

    limits: BatchLimits
    cost_model: CostModel | None
    members: list[Pending] = field(default_factory=list)
    items: int = 0
    longest: int = 0
    real: int = 0
    keys: set = field(default_factory=set)

    def add(self, p: Pending) -> None:
        self.members.append(p)
        if p.key is not None:
            self.keys.add(p.key)
        self.items += p.items
        self.longest = max(self.longest, p.longest)
        self.real += p.cost

    def at_item_cap(self) -> bool:
        return self.items >= self.limits.max_items

    def fits(self, p: Pending) -> bool:
        """Whether `p` can join without breaking the budget or the latency target, nor
        bringing in a second request with one id."""
        if p.key is not None and p.key in self.keys:
            return False
        items = self.items + p.items
        longest = max(self.longest, p.longest)
        real = self.real + p.cost
        if items > self.limits.max_items:
            return False
        tokens = padded_tokens(items, longest) if self.limits.padded else real
        if tokens > self.limits.max_tokens:
            return False
        target = self.limits.latency_target_s
        if target is None or self.cost_model is None:
            return True
        return self.cost_model.predict(BatchShape(items, longest, real)) <= target


def is_due(pending: Pending, limits: BatchLimits, now: float) -> bool:
    """Whether a request has waited past `max_wait_s` and must run next."""
    return now - pending.received > limits.max_wait_s


def take_batch(
    backlog: list[Pending],
    limits: BatchLimits,
    cost_model: CostModel | None = None,
    now: float | None = None,
    bulk_turn: bool = False,
) -> list[Pending]:
    """Remove and return the next batch from `backlog` (kept in arrival order).

    The batch is returned in arrival order. Without `now` no request counts as due;
    without a cost model the latency target is not checked. `bulk_turn`: the oldest
    request leads even if it is a job part.
    """
    if not backlog:
        return []
    first = leader(backlog, bulk_turn)
    forming = _Forming(limits, cost_model)
    forming.add(first)
    candidates = [p for p in backlog if p is not first and p.group == first.group
                  and (first.bulk or not p.bulk)]
    if now is not None:
        candidates = _add_due(forming, candidates, now)
    _fill_closest(forming, candidates)
    taken = {id(p) for p in forming.members}
    batch = [p for p in backlog if id(p) in taken]
    backlog[:] = [p for p in backlog if id(p) not in taken]
    return batch


def leader(backlog: list[Pending], bulk_turn: bool = False) -> Pending:
    """The request that leads the next batch: the oldest one a caller waits for, else
    (or on the parts' turn) the oldest."""
    if bulk_turn or not backlog[0].bulk:
        return backlog[0]
    return next((p for p in backlog if not p.bulk), backlog[0])


def _add_due(forming: _Forming, candidates: list[Pending], now: float) -> list[Pending]:
    """Add the due candidates that fit, oldest first; return the candidates left."""
    left: list[Pending] = []
    for p in candidates:
        if not forming.at_item_cap() and is_due(p, forming.limits, now) and forming.fits(p):
            forming.add(p)
        else:
            left.append(p)
    return left


def _fill_closest(forming: _Forming, candidates: list[Pending]) -> None:
    """Grow the batch with the candidates whose length is closest to its longest item.

    Candidates are bucketed by length (each bucket oldest first). Two stacks
    hold the bucket lengths below/at and above the batch's longest item, the
    closest on top, so each step looks at two buckets only: O(n log n) in
    all, which matters because `plan` forms every batch of the backlog.
    On equal distance the shorter side wins (it does not raise the longest
    item). A candidate that does not fit is dropped: the batch only grows,
    so it would not fit later either.
    """
    buckets: dict[int, deque[Pending]] = {}
    for p in candidates:
        buckets.setdefault(p.longest, deque()).append(p)
    lengths = sorted(buckets)
    split = bisect_right(lengths, forming.longest)
    below = lengths[:split]  # ascending: the closest is last
    above = lengths[split:][::-1]  # descending: the closest is last
    while (below or above) and not forming.at_item_cap():
        from_above = bool(above) and (
            not below or above[-1] - forming.longest < forming.longest - below[-1]
        )
        side = above if from_above else below
        length = side[-1]
        bucket = buckets[length]
        p = bucket.popleft()
        if not bucket:
            side.pop()
        if not forming.fits(p):
            continue
        forming.add(p)
        if from_above and bucket:  # this length is now the batch's longest
            above.pop()
            below.append(length)


def split_expired(backlog: list[Pending], now: float) -> list[Pending]:
    """Remove and return the requests whose deadline has passed (deadline <= now).

    Running them would waste the runtime on answers nobody waits for.
    """
    expired = [p for p in backlog if p.deadline is not None and p.deadline <= now]
    if expired:
        backlog[:] = [p for p in backlog if p.deadline is None or p.deadline > now]
    return expired


def is_full(batch: Iterable[Pending], limits: BatchLimits) -> bool:
    """Whether a batch has used at least half of its item or token budget."""
    batch = list(batch)
    items = sum(p.items for p in batch)
    tokens = batch_tokens(batch, limits.padded)
    return items * 2 >= limits.max_items or tokens * 2 >= limits.max_tokens


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
