"""How much work a worker should hold, and what it should give back.

A worker that holds more than it can start soon makes those requests wait
while an idler worker could run them. So a worker keeps what it expects to
start within a horizon, returns the rest to the queue, and asks the broker
(prefetch) for about that much.

The horizon is a time: `horizon_batches` typical batches, but never more than
`max_horizon_s` seconds. Counted in batches alone it grows with the batch: a
budget that makes one batch take seconds on a slow device would let a busy
worker sit on several seconds of work while a peer is idle. The seconds bound
(`max_horizon_s`) is what keeps a shared queue a shared queue: work stays in
the broker, where whichever worker frees up first takes it.

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

from batching.former import BatchLimits, is_due, take_batch
from batching.latency_model import CostModel
from batching.shapes import BatchShape, Pending

FIT_SLACK = 0.01  # of a request


@dataclass(frozen=True, slots=True)
class HoldLimits:
    horizon_batches: float = 2.0  # batches of predicted work kept beyond the running one
    max_horizon_s: float | None = None  # ... but never work predicted to start later than this
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
    return mean_batch_s(mean, mean_per_batch(mean, limits, cost_model), limits, cost_model)


def mean_batch_s(mean: MeanRequest, per_batch: int, limits: BatchLimits,
                 cost_model: CostModel) -> float:
    """Predicted latency of a batch of `per_batch` of `mean`, at least `max_delay_s`."""
    return max(cost_model.predict(mean.batch_of(per_batch)), limits.max_delay_s)


def bounded_horizon_s(typical_s: float, hold: HoldLimits) -> float:
    """`horizon_batches` batches of `typical_s`, capped at `max_horizon_s`."""
    horizon = hold.horizon_batches * typical_s
    return horizon if hold.max_horizon_s is None else min(horizon, hold.max_horizon_s)


def horizon_s(
    backlog: list[Pending], limits: BatchLimits, hold: HoldLimits, cost_model: CostModel
) -> float:
    """Seconds from now within which the work a worker keeps must be predicted to start."""
    return bounded_horizon_s(typical_batch_s(backlog, limits, cost_model), hold)


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


def may_hold(
    mean: MeanRequest | None,
    limits: BatchLimits,
    hold: HoldLimits,
    cost_model: CostModel,
    running_left_s: float,
) -> int | None:
    """How many requests like `mean` a worker may hold beside its running batch, when
    the runtime is predicted to be free in `running_left_s`: what `overflow` would keep.

    Zero while the runtime ends later than the horizon: a busy worker takes no work
    an idle peer could start now. From then on the batches that start within the
    horizon: the next one, or the horizon's worth when that is more. None without
    traffic to estimate from (`mean` None).
    """
    if mean is None:
        return None
    per_batch, typical, horizon = _mean_horizon(mean, limits, hold, cost_model)
    if running_left_s > horizon:
        return 0
    batches = horizon / typical if typical > 0 else hold.horizon_batches
    return math.ceil(max(1.0, batches) * per_batch - FIT_SLACK)


def _mean_horizon(mean: MeanRequest, limits: BatchLimits, hold: HoldLimits,
                  cost_model: CostModel) -> tuple[int, float, float]:
    """For requests like `mean`: how many fill a batch, its predicted seconds, and the
    hold horizon in seconds."""
    per_batch = mean_per_batch(mean, limits, cost_model)
    typical = mean_batch_s(mean, per_batch, limits, cost_model)
    return per_batch, typical, bounded_horizon_s(typical, hold)


def prefetch_for(
    mean: MeanRequest | None,
    limits: BatchLimits,
    hold: HoldLimits,
    cost_model: CostModel,
    default: int,
) -> int:
    """How many unacked messages to let the broker send, for a worker whose prefetch
    does not follow its running batch (a lone one): a full running batch plus what
    `may_hold` allows when it ends (at least the next batch, so it never waits for
    the broker between two; the horizon's worth when that is more).

    With no traffic to estimate from (`mean` None), `default`. Clamped.
    """
    if mean is None:
        wanted = default
    else:
        per_batch = mean_per_batch(mean, limits, cost_model)
        wanted = per_batch + (may_hold(mean, limits, hold, cost_model, 0.0) or 0)
    return max(hold.min_prefetch, min(hold.max_prefetch, wanted))


def credit_opens_in(
    mean: MeanRequest | None,
    limits: BatchLimits,
    hold: HoldLimits,
    cost_model: CostModel,
    running_left_s: float,
) -> float | None:
    """Seconds until the runtime's batch is predicted to end within the horizon, when
    `may_hold` lets in the next batch; None if it already does (or no traffic)."""
    if mean is None:
        return None
    horizon = _mean_horizon(mean, limits, hold, cost_model)[2]
    return running_left_s - horizon if running_left_s > horizon else None
