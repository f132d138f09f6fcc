"""The drain for a shutdown (`app.worker.steps.drain`, `app.worker.shutdown`): its state in
one object, and what it gives back when it begins.

The model queues' consumers are cancelled, every request that has not started is handed
back at once (requeued whole, or republished when its message is partly settled or a
requeue would bring it near the delivery limit), and what runs goes on: the running
batch, the later parts of a split request whose first part ran, the requests a
continuous runtime is generating. Their results are published, and `on_drained` is
called once the broker has confirmed every publish (their messages are then acked). A
message delivered meanwhile goes straight back (`refuse`).

`begin` returns what to give back (`GiveBack`, each requeued whole or republished as
below); the loop stops the consumers and applies them. `quiet` (the loop's: no batch in
flight, nothing held, every publish confirmed) says whether what ran is all out.
The loop (`app.worker.lifecycle.dispatcher`) marks the stretches in which it answers
(`with drain:` a batch's results, a tick's refusals), as the drain is not over until they
are all out; the end of the outermost one checks (`check` calls `on_drained` once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from app.worker import metrics
from app.worker.lifecycle.decisions import GiveBack
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.replies import Delivery

log = logging.getLogger(__name__)


class Drain:
    """Draining for a shutdown (loop thread): whether it is on, how far it got, what it
    handed back; `on_drained` is called once it is over."""

    def __init__(self, models: Collection[str], delivery_limit: int,
                 quiet: Callable[[], bool]) -> None:
        self.models = models  # the served models (a message's model is counted if one)
        self.delivery_limit = delivery_limit
        self.quiet = quiet  # nothing running or held here, every publish confirmed
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

    def begin(self, not_started: dict[str, list[Held]]) -> list[GiveBack]:
        """Draining from now: every request that has not started (by model, taken out of
        where it waited) is given back; what runs goes on."""
        self.active = True
        back = [GiveBack(model, held, self._near_delivery_limit)
                for model, held in not_started.items() if held]
        for give in back:
            metrics.HANDED_BACK.labels(give.model).inc(len(give.held))
            self.handed_back += len(give.held)
        self.begun = True
        return back

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
        if isinstance(model, str) and model in self.models:
            metrics.HANDED_BACK.labels(model).inc()

    @property
    def drained(self) -> bool:
        """Its hand-back done, nothing answering, running or held, every publish
        confirmed."""
        return self.begun and not self.answering and self.quiet()

    def check(self) -> None:
        """Call `on_drained` (once) if the drain is over."""
        if self.active and not self.reported and self.drained:
            self.reported = True
            self.on_drained()

    def abandon(self) -> None:
        """A forced end: `on_drained` is never called."""
        self.reported = True
