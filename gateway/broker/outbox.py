"""Each model's outbox: requests published with confirms, coalesced under load.

Requests are not published one message each under load. Each model has an
outbox: a request goes out on the loop's next turn, alone when it is alone
(a plain Celery message), and while `publishes_in_flight` publishes of its
model await their confirms, the requests that arrive meanwhile wait and go
out together as one coalesced message (`tasks.envelope.coalesce`). No timer
is involved: an idle gateway publishes at once, a busy one sends fewer,
fuller messages, and the broker and the worker handle one message for many
requests.

Every publish waits for the broker's confirm: a nack from a full queue becomes 429
QUEUE_FULL, anything else that keeps the message from its queue 503
BROKER_UNAVAILABLE (retryable).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass

import aio_pika
from aiormq.exceptions import DeliveryError, PublishError
from pamqp.commands import Basic

from gateway.broker.broker_errors import unavailable
from gateway.broker.queue_declarations import ModelQueues
from gateway.edge.api_errors import ApiError
from gateway.edge.gateway_metrics import REQUESTS_PER_MESSAGE
from gateway.edge.tracing import publish_span
from tasks import tracing
from tasks.envelope import CONTENT_ENCODING, CONTENT_TYPE, Part, coalesce, single_message
from tasks.errors import ErrorCode
from tasks.settings import Settings

# A coalesced message carries at most this many requests and body bytes; a request
# bigger than COALESCE_MAX_PART_BYTES (an image, a long document) goes alone.
COALESCE_MAX_PARTS = 256
COALESCE_MAX_BYTES = 1024 * 1024
COALESCE_MAX_PART_BYTES = 64 * 1024


@dataclass(slots=True)
class _Outgoing:
    """A request waiting in its model's outbox, and the future its caller awaits until
    the broker has confirmed it."""

    part: Part
    timeout_s: float
    confirmed: asyncio.Future[None]
    # Taken out of the outbox to be published: a caller that leaves from then on must
    # revoke it (before, its cancelled wait keeps it from ever being published).
    taken: bool = False


class Outbox:
    """The requests waiting to be published, per model, and the publishing itself."""

    def __init__(self, settings: Settings, queues: ModelQueues, origin: str,
                 reply_to: str) -> None:
        self.settings = settings
        self.queues = queues
        self.origin = origin
        self.reply_to = reply_to  # where results go unless a publish names another queue
        self.exchange: aio_pika.abc.AbstractExchange | None = None  # set once connected
        self._outbox: dict[str, list[_Outgoing]] = {}
        self._in_flight: defaultdict[str, int] = defaultdict(int)
        self._flush_due: set[str] = set()

    async def send(self, model: str, part: Part, timeout_s: float) -> None:
        """Put the request in its model's outbox; return once the broker has it."""
        await self.enqueue(model, part, timeout_s).confirmed

    def enqueue(self, model: str, part: Part, timeout_s: float) -> _Outgoing:
        """Put the request in its model's outbox; its `confirmed` resolves once the broker
        has it. Cancelling that wait before the request is `taken` withdraws it."""
        outgoing = _Outgoing(part, timeout_s, asyncio.get_running_loop().create_future())
        if tracing.ENABLED:  # its message carries its publish span's context
            outgoing.part = publish_span(model, self.queues.queues[model].name, part,
                                         outgoing.confirmed)
        self.put(model, outgoing)
        return outgoing

    def put(self, model: str, outgoing: _Outgoing) -> None:
        self._outbox.setdefault(model, []).append(outgoing)
        self._schedule_flush(model)

    def _schedule_flush(self, model: str) -> None:
        # On the loop's next turn, so that requests that arrive together leave together.
        if model in self._flush_due or self._in_flight[model] >= self.settings.publishes_in_flight:
            return
        self._flush_due.add(model)
        asyncio.get_running_loop().call_soon(self._flush, model)

    def _flush(self, model: str) -> None:
        self._flush_due.discard(model)
        # A caller that gave up (timeout, disconnect) cancelled its wait: not published.
        waiting = [o for o in self._outbox.pop(model, ()) if not o.confirmed.done()]
        if not waiting:
            return
        for o in waiting:
            o.taken = True
        groups = _coalescible(waiting) if self.settings.coalesce else [[o] for o in waiting]
        self._in_flight[model] += 1
        task = asyncio.get_running_loop().create_task(self._publish_groups(model, groups))
        task.add_done_callback(lambda _: self._flushed(model))

    def _flushed(self, model: str) -> None:
        self._in_flight[model] -= 1
        if self._outbox.get(model):
            self._schedule_flush(model)

    async def _publish_groups(self, model: str, groups: list[list[_Outgoing]]) -> None:
        async def publish(group: list[_Outgoing]) -> None:
            REQUESTS_PER_MESSAGE.observe(len(group))
            try:
                if len(group) == 1:
                    message = single_message(group[0].part, self.origin)
                else:
                    parts = [o.part for o in group]
                    message = coalesce(model, parts[0].annotations.op, parts, self.origin)
                # The message lives as long as its longest-lived request; each request's
                # own deadline is the worker's to enforce.
                await self.publish(model, message.task_id, message.body, message.headers,
                                   max(o.timeout_s for o in group))
            except ApiError as exc:
                for o in group:
                    if not o.confirmed.done():
                        o.confirmed.set_exception(exc)
            else:
                for o in group:
                    if not o.confirmed.done():
                        o.confirmed.set_result(None)

        await asyncio.gather(*(publish(group) for group in groups))

    async def publish(
        self, model: str, task_id: str, body: bytes, headers: dict, timeout_s: float,
        reply_to: str | None = None,
    ) -> None:
        """One message to the model's queue, persistent, expiring with its deadline;
        return once the broker confirmed it."""
        assert self.exchange is not None
        message = aio_pika.Message(
            body,
            headers=headers,
            content_type=CONTENT_TYPE,
            content_encoding=CONTENT_ENCODING,
            correlation_id=task_id,
            reply_to=reply_to or self.reply_to,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            expiration=max(timeout_s, 0.001),
        )
        try:
            await self.exchange.publish(
                message, routing_key=self.queues.queues[model].name, mandatory=True
            )
        except PublishError:
            # Deleted behind our back: the next request declares it again.
            self.queues.forget(model)
            raise unavailable(f"the queue of {model} does not exist on the broker") from None
        except DeliveryError as exc:
            if isinstance(exc.frame, Basic.Nack):
                raise ApiError(
                    ErrorCode.QUEUE_FULL,
                    f"the queue of {model} is full; retry later",
                    retry_after=self.settings.retry_after_s,
                ) from None
            raise unavailable(f"the broker did not take the message: {exc}") from None
        except (aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            raise unavailable(f"the message broker is not reachable: {exc}") from None
        except asyncio.CancelledError:
            # The connection dropped with the confirm outstanding (aiormq cancels what
            # awaits it): the message may or may not be queued; the caller may retry.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise unavailable("the broker connection dropped before the broker confirmed "
                              "the request") from None


def _coalescible(waiting: list[_Outgoing]) -> list[list[_Outgoing]]:
    """Groups to publish: big and claim-checked requests alone, the rest together within
    the caps."""
    groups: list[list[_Outgoing]] = []
    current: list[_Outgoing] = []
    size = 0
    for o in waiting:
        # A claim-checked request goes alone: its `shoal_claims` header must be its own.
        if len(o.part.body) > COALESCE_MAX_PART_BYTES or o.part.annotations.claims:
            groups.append([o])
            continue
        if current and (len(current) >= COALESCE_MAX_PARTS
                        or size + len(o.part.body) > COALESCE_MAX_BYTES):
            groups.append(current)
            current, size = [], 0
        current.append(o)
        size += len(o.part.body)
    if current:
        groups.append(current)
    return groups
