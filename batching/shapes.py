"""What the scheduler knows of a request and of a batch, without reading any body.

Both the batch former and the cost model speak in these terms, so they live
apart from either (and neither imports the other).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Pending:
    """A request held by the worker, described by its annotations only.

    Built positionally, once per request, by `app.worker.lifecycle.intake.Intake.pending`
    (keywords cost more than the rest of it): a new field goes last, with a default, or
    that call changes with it."""

    handle: Any  # opaque to the scheduler: the worker's message
    group: Hashable  # what must not be mixed (op, split parts; LoRA when told not to mix)
    items: int
    cost: int  # estimated real tokens of the request
    longest: int  # estimated tokens of its longest item
    received: float  # seconds, same clock as `now`
    deadline: float | None = None  # seconds, same clock; None = none
    # The whole time its caller allowed (deadline less when it was sent), if known: what a
    # retry of it would get again.
    budget_s: float | None = None
    deliveries: int = 1  # 1 + RabbitMQ's x-delivery-count header
    returnable: bool = True  # False: the worker must run it (a part of a begun request)
    # The request's id, if it has one. Two held requests may share one (a gateway that
    # republished after a reconnect, a job part published again after a takeover); the
    # runtime answers a batch by id, so two with one id never run in one batch.
    key: Hashable | None = None
    # A bulk job's part: it runs when no request a caller waits for is held (or when job
    # parts were passed over `BatchLimits.bulk_pass_s`).
    bulk: bool = False


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What the latency of a batch depends on."""

    items: int
    longest: int
    tokens: int  # real tokens

    @classmethod
    def of(cls, batch: Iterable[Pending]) -> BatchShape:
        items = longest = tokens = 0
        for p in batch:
            items += p.items
            longest = max(longest, p.longest)
            tokens += p.cost
        return cls(items, longest, tokens)


def padded_tokens(items: int, longest: int) -> int:
    return items * longest


def batch_tokens(batch: Iterable[Pending], padded: bool) -> int:
    """The tokens a batch costs against the budget.

    A padded runtime computes every item at the length of the longest one, so
    it pays items x longest; an unpadded (packed) one pays real tokens only.
    """
    shape = BatchShape.of(batch)
    return padded_tokens(shape.items, shape.longest) if padded else shape.tokens
