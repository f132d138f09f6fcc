"""Draining for a shutdown (`begin_drain`, see `app.worker.shutdown`).

The model queues' consumers are cancelled, every request that has not started is handed
back at once (requeued whole, or republished when its message is partly settled or a
requeue would bring it near the delivery limit), and what runs goes on: the running
batch, the later parts of a split request whose first part ran, the requests a
continuous runtime is generating. Their results are published, and `on_drained` is
called once the broker has confirmed every publish (their messages are then acked). A
message delivered meanwhile goes straight back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from app.worker import metrics
from app.worker.lifecycle.replies import Delivery

if TYPE_CHECKING:
    from app.worker.lifecycle.dispatcher import Dispatcher

log = logging.getLogger(__name__)


class Drain:
    """The dispatcher's drain (loop thread); a mixin of `Dispatcher`."""

    def begin_drain(self: Dispatcher) -> dict[str, int]:
        """Stop consuming, hand back every request that has not started; what runs goes
        on. The requests handed back, by model. `on_drained` is called once nothing runs
        and every publish is confirmed (`check_drained`: call it after this)."""
        self.draining = True
        self.consumers.stop()
        handed: dict[str, int] = {}
        for model in self.scheduler.lanes:
            back = self.holdings.not_started(model)
            if back:
                self._give_back(model, back, self._near_delivery_limit)
                metrics.HANDED_BACK.labels(model).inc(len(back))
                handed[model] = len(back)
            metrics.HELD.labels(model).set(len(self.scheduler.lanes[model].backlog))
        self.drain_handed_back += sum(handed.values())
        self._drain_begun = True
        return handed

    def _near_delivery_limit(self: Dispatcher, delivery: Delivery) -> bool:
        """A requeue would bring it near the queue's delivery limit (quorum queues count
        every requeue): it is republished instead, as a new message."""
        deliveries = 1 + int((delivery.message.headers or {}).get("x-delivery-count") or 0)
        return self.delivery_limit >= 0 and deliveries > self.delivery_limit // 2

    def _refuse_delivery(self: Dispatcher, message: Any) -> None:
        try:
            message.reject(requeue=True)
        except Exception:  # the channel is gone: the broker requeues it anyway
            log.warning("could not hand back a message delivered while draining",
                        exc_info=True)
        self.drain_handed_back += 1
        model = (message.headers or {}).get("shoal_model")
        if isinstance(model, str) and model in self.scheduler.lanes:
            metrics.HANDED_BACK.labels(model).inc()

    @property
    def unfinished(self: Dispatcher) -> int:
        """Requests running or bound to run here: the running batch, the parts of split
        requests left to run, the requests a continuous runtime is generating."""
        return self.holdings.unfinished

    @property
    def drained(self: Dispatcher) -> bool:
        """Draining, nothing runs, nothing is held, every publish is confirmed."""
        return (self._drain_begun and not self._answering and not self.futures
                and self.holdings.empty and self.replier.unconfirmed == 0)

    def check_drained(self: Dispatcher) -> None:
        """Call `on_drained` (once) if the drain is over."""
        if self.draining and not self._drain_reported and self.drained:
            self._drain_reported = True
            self.on_drained()

    def abandon(self: Dispatcher) -> int:
        """A forced end: publish and ack nothing more (the broker redelivers it); the
        number of requests that were running."""
        unfinished = self.unfinished
        self._drain_reported = True
        self.drop_held()
        return unfinished
