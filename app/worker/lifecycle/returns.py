"""Giving requests back to their queue, for other workers.

The scheduler returns what this worker would hold too long while a peer could run it;
a drain hands back everything that has not started. A message from a shoal gateway may
carry several requests (coalesced, see `tasks.envelope.coalesce`): the message goes back
whole (reject + requeue) when nothing else of it has been settled, else its returned
members are republished as a message of their own before the original is acked: a
message cannot be requeued in part. `Returns` is what the loop, the continuous feed and
the drain give back through: it knows each model's queue and this worker's name.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from app.worker.lifecycle import traces
from app.worker.lifecycle.consumers import Consumers
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.loop import Identity
from app.worker.lifecycle.replies import Delivery, Replier
from tasks import tracing
from tasks.envelope import H_DEADLINE, Part, coalesce

ReturnKey = tuple[str, str | None, bool]  # operation, reply_to, reply_batch


def plan_returns(returned: list[Held], renew: Callable[[Delivery], bool] | None = None
                 ) -> tuple[list[Delivery], dict[ReturnKey, list[Held]]]:
    """How to give requests back: (messages to requeue whole, requests to republish).

    A message goes back whole (reject + requeue, which keeps its delivery count)
    when every request it carries is returned and none is settled, unless `renew`
    says its delivery count must not grow. A message cannot be requeued in part,
    so the returned requests of any other message are republished, grouped into
    one message per operation and caller (their replies go where the original's
    would have); each counts one more return.
    """
    by_delivery: dict[int, list[Held]] = {}
    for held in returned:
        by_delivery.setdefault(id(held.delivery), []).append(held)
    whole: list[Delivery] = []
    handed_on: dict[ReturnKey, list[Held]] = {}
    for helds in by_delivery.values():
        delivery = helds[0].delivery
        if delivery.untouched and len(helds) == delivery.requests and not (
                renew is not None and renew(delivery)):
            whole.append(delivery)
            continue
        for held in helds:
            key = (held.annotations.op, delivery.reply_to, delivery.reply_batch)
            handed_on.setdefault(key, []).append(held)
    return whole, handed_on


def give_back(model: str, returned: list[Held], queue: str | None, replier: Replier,
              hostname: str, renew: Callable[[Delivery], bool] | None = None) -> None:
    """Return requests to their queue (see `plan_returns`); `queue` None: not consuming
    (the connection was lost), so only whole messages are requeued (the rest is
    redelivered anyway)."""
    if tracing.ENABLED:
        for held in returned:
            traces.settled(held, "returned")
    whole, handed_on = plan_returns(returned, renew)
    for delivery in whole:
        delivery.requeue()
    if queue is None:
        return
    for (op, _, reply_batch), helds in handed_on.items():
        members = [Part(h.task_id, h.annotations, h.body, h.returns + 1) for h in helds]
        # The result contract its sender reads (one reply queue: one sender, one contract).
        message = coalesce(model, op, members, hostname, reply_batch,
                           helds[0].delivery.contract)
        deadline_ms = message.headers.get(H_DEADLINE)  # its longest-lived request's
        expiration = None if deadline_ms is None else deadline_ms / 1000 - time.time()
        replier.forward([h.delivery for h in helds], queue, message.body,
                        message.headers, expiration)


class Returns:
    """Gives requests back to their model's queue (loop thread)."""

    def __init__(self, consumers: Consumers, replier: Replier, loop: Identity) -> None:
        self.consumers = consumers  # each model's queue, None once the connection is lost
        self.replier = replier
        self.loop = loop  # its hostname marks what is republished

    def give_back(self, model: str, returned: list[Held],
                  renew: Callable[[Delivery], bool] | None = None) -> None:
        """See `give_back`."""
        give_back(model, returned, self.consumers.queue(model), self.replier,
                  self.loop.hostname, renew)
