"""How much work a worker should hold, and what it should give back.

A worker that holds more than it can start soon makes those requests wait
while an idler worker could run them. So a worker keeps what it expects to
start within a horizon of `horizon_batches` typical batches beyond the one
running, returns the rest to the queue, and asks the broker (prefetch) for
about that much.

Returning has a price on quorum queues: every requeue counts toward the
queue's `x-delivery-limit`, and a message past it is dead-lettered. So a
message is returned only while it has used at most half of its deliveries;
after that the worker keeps it and runs it however long it waits, so being
returned can never be what dead-letters a message. Requests already past
`max_wait_s` are due and are kept too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from batching.cost import CostModel
from batching.former import BatchLimits, is_due, take_batch
from batching.shapes import BatchShape, Pending

FIT_SLACK = 0.01  # of a request


@dataclass(frozen=True, slots=True)
class HoldLimits:
    horizon_batches: float = 2.0  # batches of predicted work kept beyond the running one
    delivery_limit: int = 20  # the queue's x-delivery-limit
    min_prefetch: int = 1
    max_prefetch: int = 256


def may_return(pending: Pending, delivery_limit: int) -> bool:
    """Whether giving `pending` back can never be what dead-letters it.

    Only while it has used at most half of the delivery limit; a negative
    limit means the queue has none (RabbitMQ accepts -1 for that). A request
    the worker has begun (`returnable` false: a part of a split request) stays.
    """
    if not pending.returnable:
        return False
    if delivery_limit < 0:
        return True
    return pending.deliveries <= delivery_limit // 2


def plan(
    backlog: list[Pending],
    limits: BatchLimits,
    cost_model: CostModel,
    now: float | None = None,
) -> list[list[Pending]]:
    """The batches `take_batch` would form, in order, from a copy of the backlog.

    `backlog` is left untouched. Pass `now` to plan with due requests
    promoted as `take_batch(..., now=now)` would.
    """
    rest = list(backlog)
    batches: list[list[Pending]] = []
    while rest:
        batches.append(take_batch(rest, limits, cost_model, now))
    return batches


def planned_starts(
    batches: list[list[Pending]], cost_model: CostModel, running_left_s: float
) -> list[float]:
    """Predicted seconds from now until each planned batch starts."""
    starts: list[float] = []
    start = running_left_s
    for batch in batches:
        starts.append(start)
        start += cost_model.predict(BatchShape.of(batch))
    return starts


@dataclass(frozen=True, slots=True)
class MeanRequest:
    """The typical request of some traffic: mean items, longest item and real tokens."""

    items: float
    longest: float
    cost: float

    @classmethod
    def of(cls, requests: Sequence[Pending]) -> MeanRequest | None:
        if not requests:
            return None
        n = len(requests)
        return cls(sum(p.items for p in requests) / n, sum(p.longest for p in requests) / n,
                   sum(p.cost for p in requests) / n)

    def batch_of(self, k: int) -> BatchShape:
        """The shape of a batch of `k` such requests."""
        return BatchShape(round(k * self.items), round(self.longest), round(k * self.cost))


def mean_per_batch(mean: MeanRequest, limits: BatchLimits, cost_model: CostModel) -> int:
    """How many of `mean` fill a batch (at least 1).

    Closest-length filling groups similar lengths, so a batch's longest item
    is near its members' own and the mean is a fair stand-in.
    """
    per_message = mean.items * mean.longest if limits.padded else mean.cost
    fit = limits.max_items / max(mean.items, 1e-9)
    if per_message > 0:
        fit = min(fit, limits.max_tokens / per_message)
    # A mean a hair above an exact fraction of the budget (as a running average that
    # converges on it is) still counts as that fraction.
    count = max(1, math.floor(fit + FIT_SLACK))
    target = limits.latency_target_s
    if target is None:
        return count
    low, high = 1, count  # predictions grow with k: find the largest k not too slow
    while low < high:
        mid = (low + high + 1) // 2
        if cost_model.predict(mean.batch_of(mid)) > target:
            high = mid - 1
        else:
            low = mid
    return low


def messages_per_batch(backlog: list[Pending], limits: BatchLimits, cost_model: CostModel) -> int:
    """How many of the backlog's mean request fill a batch (at least 1)."""
    mean = MeanRequest.of(backlog)
    return 1 if mean is None else mean_per_batch(mean, limits, cost_model)


def typical_batch_s(backlog: list[Pending], limits: BatchLimits, cost_model: CostModel) -> float:
    """Predicted latency of a full batch of the backlog's mean request, at least `max_delay_s`.

    A full batch rather than the first planned one: the head of the backlog
    may be a lone request of a rare group, which would shrink the horizon to
    almost nothing and make the worker return work it could run soon.
    """
    mean = MeanRequest.of(backlog)
    if mean is None:
        return limits.max_delay_s
    shape = mean.batch_of(mean_per_batch(mean, limits, cost_model))
    return max(cost_model.predict(shape), limits.max_delay_s)


def horizon_s(
    backlog: list[Pending], limits: BatchLimits, hold: HoldLimits, cost_model: CostModel
) -> float:
    """Seconds of predicted work a worker keeps ahead of it."""
    return hold.horizon_batches * typical_batch_s(backlog, limits, cost_model)


def overflow(
    backlog: list[Pending],
    limits: BatchLimits,
    hold: HoldLimits,
    cost_model: CostModel,
    running_left_s: float,
    now: float,
) -> list[Pending]:
    """The requests this worker should give back, in backlog order.

    Plans the batches; the members of every batch predicted to start later
    than the horizon are returned, except those `may_return` refuses and those
    already due. `backlog` is not modified: the caller removes what it returns.
    """
    batches = plan(backlog, limits, cost_model, now)
    horizon = horizon_s(backlog, limits, hold, cost_model)
    starts = planned_starts(batches, cost_model, running_left_s)
    giving = {
        id(p)
        for batch, start in zip(batches, starts, strict=True)
        if start > horizon
        for p in batch
        if may_return(p, hold.delivery_limit) and not is_due(p, limits, now)
    }
    return [p for p in backlog if id(p) in giving]


def target_prefetch(
    backlog: list[Pending],
    limits: BatchLimits,
    hold: HoldLimits,
    cost_model: CostModel,
    default: int,
) -> int:
    """`prefetch_for` the backlog's mean request."""
    return prefetch_for(MeanRequest.of(backlog), limits, hold, cost_model, default)


def prefetch_for(
    mean: MeanRequest | None,
    limits: BatchLimits,
    hold: HoldLimits,
    cost_model: CostModel,
    default: int,
) -> int:
    """How many unacked messages to let the broker send, so that what the worker
    holds is about the running batch plus `horizon_batches` more of `mean`.

    With no traffic to estimate from (`mean` None), `default` (clamped).
    """
    if mean is None:
        wanted = default
    else:
        per_batch = mean_per_batch(mean, limits, cost_model)
        wanted = math.ceil((1.0 + hold.horizon_batches) * per_batch)
    return max(hold.min_prefetch, min(hold.max_prefetch, wanted))
