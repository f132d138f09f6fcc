"""The drain for a shutdown (`app.worker.steps.drain`, `app.worker.shutdown`): its state in
one object, and the hand-back that begins it.

The model queues' consumers are cancelled, every request that has not started is handed
back at once (requeued whole, or republished when its message is partly settled or a
requeue would bring it near the delivery limit), and what runs goes on: the running
batch, the later parts of a split request whose first part ran, the requests a
continuous runtime is generating. Their results are published, and `on_drained` is
called once the broker has confirmed every publish (their messages are then acked). A
message delivered meanwhile goes straight back (`refuse`).

The loop (`app.worker.lifecycle.dispatcher`) marks the stretches in which it answers
(`with drain:` a batch's results, a tick's refusals), as the drain is not over until they
are all out; the end of the outermost one checks (`check` calls `on_drained` once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from app.worker import metrics
from app.worker.lifecycle.batches import Batches
from app.worker.lifecycle.consumers import Consumers
from app.worker.lifecycle.held import Holdings
from app.worker.lifecycle.replies import Delivery, Replier
from app.worker.lifecycle.returns import Returns
from batching.scheduler import Scheduler

log = logging.getLogger(__name__)


class Drain:
    """Draining for a shutdown (loop thread): whether it is on, how far it got, what it
    handed back; `on_drained` is called once it is over."""

    def __init__(self, scheduler: Scheduler, holdings: Holdings, consumers: Consumers,
                 returns: Returns, batches: Batches, replier: Replier,
                 delivery_limit: int) -> None:
        self.scheduler = scheduler
        self.holdings = holdings
        self.consumers = consumers
        self.returns = returns
        self.batches = batches
        self.replier = replier
        self.delivery_limit = delivery_limit
        self.active = False  # draining: nothing new is held, what runs finishes
        self.begun = False  # its hand-back is done: `on_drained` may be called
        self.reported = False  # `on_drained` was called (or the drain was abandoned)
        self.answering = 0  # answering stretches open (a batch's results, refusals)
        self.handed_back = 0  # requests handed back when the drain began, or after
        self.answered = 0  # requests answered while draining (`Answers` counts them)
        self.on_drained: Callable[[], None] = lambda: None

    def __enter__(self) -> None:
        """A stretch of answers begins: the one place `answering` goes up."""
        self.answering += 1

    def __exit__(self, *exc: object) -> None:
        self.answering -= 1
        if not self.answering:
            self.check()

    def begin(self) -> dict[str, int]:
        """Stop consuming, hand back every request that has not started; what runs goes
        on. The requests handed back, by model."""
        self.active = True
        self.consumers.stop()
        handed: dict[str, int] = {}
        for model in self.scheduler.lanes:
            back = self.holdings.not_started(model)
            if back:
                self.returns.give_back(model, back, self._near_delivery_limit)
                metrics.HANDED_BACK.labels(model).inc(len(back))
                handed[model] = len(back)
            metrics.HELD.labels(model).set(len(self.scheduler.lanes[model].backlog))
        self.handed_back += sum(handed.values())
        self.begun = True
        return handed

    def _near_delivery_limit(self, delivery: Delivery) -> bool:
        """A requeue would bring it near the queue's delivery limit (quorum queues count
        every requeue): it is republished instead, as a new message."""
        deliveries = 1 + int((delivery.message.headers or {}).get("x-delivery-count") or 0)
        return self.delivery_limit >= 0 and deliveries > self.delivery_limit // 2

    def refuse(self, message: Any) -> None:
        """A message delivered while draining (before the broker saw the consumer
        cancelled): straight back."""
        try:
            message.reject(requeue=True)
        except Exception:  # the channel is gone: the broker requeues it anyway
            log.warning("could not hand back a message delivered while draining",
                        exc_info=True)
        self.handed_back += 1
        model = (message.headers or {}).get("shoal_model")
        if isinstance(model, str) and model in self.scheduler.lanes:
            metrics.HANDED_BACK.labels(model).inc()

    @property
    def drained(self) -> bool:
        """Its hand-back done, nothing answering, running or held, every publish
        confirmed."""
        return (self.begun and not self.answering and self.batches.idle
                and self.holdings.empty and self.replier.unconfirmed == 0)

    def check(self) -> None:
        """Call `on_drained` (once) if the drain is over."""
        if self.active and not self.reported and self.drained:
            self.reported = True
            self.on_drained()

    def abandon(self) -> None:
        """A forced end: `on_drained` is never called."""
        self.reported = True
