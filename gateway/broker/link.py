"""The gateway's link to RabbitMQ: connect and fail over, publish, await replies.

One robust connection with two channels: one publishes with publisher
confirms (a nack from a full queue becomes 429), the other consumes this
gateway's exclusive reply queue, whose messages resolve futures keyed by
correlation id. `Broker` connects and fails over, and runs a request through
the pieces of one concern each:

- `gateway.broker.served_models`: whether a worker serves the model (the workers'
  pool states, subscribed there; 503 MODEL_UNAVAILABLE if none does);
- `gateway.broker.queue_declarations`: the model's queue, declared on its first
  request, and its consumer count;
- `gateway.broker.outbox`: the publish with confirms, coalescing requests under load;
- `gateway.broker.reply_futures`: the result awaited by correlation id;
- `gateway.broker.streams`: a streamed request's PROGRESS states, and the cancels of
  requests whose callers left.

Failover: SHOAL_BROKER_URL may list several nodes of one cluster (`;`-separated); the
connection (`gateway.broker.failover`) moves to the next one when its node goes, at most
SHOAL_BROKER_RECONNECT_MAX_S apart, and restores its channels, queues and consumers
there. While it is down, requests are refused with 503 BROKER_UNAVAILABLE (retryable),
and so is every publish that was not confirmed when the connection dropped: it may or
may not have reached the queue, and the caller may safely send it again. A request whose
publish was confirmed waits for its result; but this gateway's reply queue is exclusive
to its connection and went with the node it lived on, taking any reply in it, or sent to
it while it was gone. So once reconnected, the gateway publishes every such request
again (same task id): whichever answer comes first settles it, a second is dropped as a
duplicate. The cost is a recomputation of what was in flight; nothing is lost. Jobs'
parts are not published again: their replies go to the jobs' durable quorum queue,
which outlives any one node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import aio_pika

from gateway.broker.broker_errors import late, unavailable
from gateway.broker.deadlines import Deadlines
from gateway.broker.failover import FailoverConnection, connect_failover
from gateway.broker.outbox import Outbox, _Outgoing
from gateway.broker.pool_view import PoolView
from gateway.broker.queue_declarations import ModelQueues
from gateway.broker.reply_futures import AwaitedReplies
from gateway.broker.revokes import Revokes
from gateway.broker.served_models import ServedModels
from gateway.broker.streams import ReplyStreams
from gateway.edge.caller_left import forget_caller, on_caller_left
from gateway.edge.gateway_metrics import CALLERS_LEFT
from tasks.broker_metrics import gateway_link
from tasks.broker_urls import split_urls
from tasks.envelope import Part, coalesce, single_message
from tasks.errors import ErrorCode, ShoalError
from tasks.settings import Settings
from tasks.topology import QueueType, dead_letter_exchange, task_exchange

log = logging.getLogger(__name__)


class Broker:
    def __init__(self, settings: Settings, models: list[str],
                 queue_types: Mapping[str, QueueType | None] | None = None) -> None:
        """`models`: the models it accepts requests for; `queue_types`: their catalog
        entries' `queue_type`, where set (a model without one gets SHOAL_QUEUE_TYPE's)."""
        self.settings = settings
        self.models = models
        tag = uuid.uuid4().hex
        self.reply_to = f"{settings.queue_prefix}.reply.{tag}"
        # This gateway's copy of the workers' pool states (exclusive, bound to the fanout).
        self.pool_queue = f"{settings.queue_prefix}.pool.{tag}"
        self.origin = f"gateway@{socket.gethostname()}:{os.getpid()}"
        self.queues = ModelQueues(settings, {m: (queue_types or {}).get(m) for m in models})
        self.served = ServedModels(settings, self.queues, self.pool_queue)
        self.outbox = Outbox(settings, self.queues, self.origin, self.reply_to)
        self.replies = AwaitedReplies()
        self.deadlines = Deadlines()  # of the requests awaited (`submit`)
        self.streams = ReplyStreams(self.replies, self.pool, self._connected, self._send,
                                    lambda: self._connection)
        self.revokes = Revokes(self.streams.cancel)  # of requests whose callers hung up
        self._connection: FailoverConnection | None = None
        self.urls = split_urls(settings.broker_url)
        self.link = gateway_link()
        self._age_reporter: asyncio.Task | None = None
        self._link_up = False
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._ready = False
        self._task: asyncio.Task | None = None
        # Called with the connection once it is up (the jobs' shared reply consumer); a
        # robust connection restores what they declare and consume after a reconnect.
        self.on_connect: list[Callable[[aio_pika.abc.AbstractRobustConnection],
                                       Awaitable[None]]] = []

    @property
    def pool(self) -> PoolView:
        """The workers' pool states as this gateway heard them."""
        return self.served.pool

    @property
    def ready(self) -> bool:
        conn = self._connection
        return (self._ready and self._link_up and conn is not None and not conn.is_closed
                and conn.connected.is_set())

    def _connected(self) -> bool:
        """Whether a request may be published now."""
        return self.ready and self._exchange is not None

    def start(self) -> None:
        """Connect in the background, retrying until the broker answers."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._connect_forever())
        self._age_reporter = loop.create_task(self.replies.report_oldest_waiting(self.models))

    def oldest_waiting(self, now: float) -> dict[str, float]:
        """Per model, seconds since the oldest request with nothing answered came in."""
        return self.replies.oldest_waiting(now)

    async def _connect_forever(self) -> None:
        delay = 0.2
        while True:
            try:
                await self._connect()
                return
            except Exception as exc:
                log.warning("broker not reachable (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.broker_reconnect_max_s)

    async def _connect(self) -> None:
        connection = await connect_failover(
            self.urls,
            timeout=self.settings.broker_connect_timeout_s,
            heartbeat=int(self.settings.broker_heartbeat),
            reconnect_interval=self.settings.broker_reconnect_max_s,
            client_properties={"connection_name": self.origin},
        )
        try:
            publish_channel = await connection.channel(publisher_confirms=True,
                                                       on_return_raises=True)
            prefix = self.settings.queue_prefix
            self._exchange = await publish_channel.declare_exchange(
                task_exchange(prefix), aio_pika.ExchangeType.DIRECT, durable=True)
            self.outbox.exchange = self._exchange
            # Queues are declared on their own channel (see gateway.broker.queue_declarations).
            topology = await connection.channel(publisher_confirms=False)
            dead_exchange = await topology.declare_exchange(
                dead_letter_exchange(prefix), aio_pika.ExchangeType.DIRECT, durable=True)
            self.queues.attach(topology, self._exchange, dead_exchange)
            reply_channel = await connection.channel(publisher_confirms=False)
            reply_queue = await reply_channel.declare_queue(
                self.reply_to, exclusive=True, auto_delete=True
            )
            await reply_queue.consume(self.replies.on_reply, no_ack=True)
        except Exception:
            await connection.close()
            raise
        await self.served.subscribe(connection)
        for hook in self.on_connect:
            await hook(connection)
        self._connection = connection
        connection.close_callbacks.add(self._on_link_lost)
        connection.reconnect_callbacks.add(self._on_link_back)
        self._ready = self._link_up = True
        self.link.connected(connection.endpoint)
        log.info("gateway connected to %s; replies on %s", connection.endpoint, self.reply_to)

    def _on_link_lost(self, _connection: object, exc: BaseException | None = None) -> None:
        if not self._link_up:
            return
        self._link_up = False
        self.replies.orphan_awaited()
        self.link.lost(repr(exc))

    def _on_link_back(self, connection: FailoverConnection) -> None:
        # Called once the robust connection has restored every channel, queue and consumer
        # (the reply queue among them) on the node it reached.
        self._link_up = True
        self.link.connected(connection.endpoint)
        again = self.replies.take_orphaned()
        if again:
            log.warning("publishing %d requests again: their replies may have gone with the "
                        "broker node this gateway was connected to", len(again))
        loop = asyncio.get_running_loop()
        for task_id, awaited in again:
            remaining = awaited.deadline - loop.time()
            if remaining <= 0:
                continue
            outgoing = _Outgoing(awaited.part, remaining, loop.create_future())
            outgoing.confirmed.add_done_callback(
                lambda done, task_id=task_id: self.replies.republished(task_id, done))
            self.outbox.put(awaited.model, outgoing)

    async def close(self) -> None:
        for task in (self._task, self._age_reporter):
            if task is not None:
                task.cancel()
        self._link_up = False  # closing is no outage
        if self._connection is not None:
            await self._connection.close()
        self.replies.cancel_all()

    # --- requests ------------------------------------------------------------------------

    async def submit(self, model: str, part: Part, timeout_s: float,
                     caller: MutableMapping[str, Any] | None = None) -> dict:
        """Publish a request (alone or coalesced with others waiting for the same model)
        and wait for its result until `timeout_s` runs out. 503 MODEL_UNAVAILABLE at once
        for a model no worker serves, unless SHOAL_GATEWAY_UNSERVED=wait.

        `caller`: the ASGI scope of the HTTP request that waits. If its caller hangs up
        first (`gateway.edge.caller_left`), the request is released: withdrawn from the
        outbox if not yet published, else revoked on every worker (`Revokes`); the wait
        ends with CANCELLED (499), which nobody reads."""
        if not self._connected():
            raise unavailable("the message broker is not connected")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        task_id = part.task_id
        self.replies.pending[task_id] = future
        self.replies.unanswered[task_id] = (model, loop.time())
        deadline = self.deadlines.add(timeout_s)
        if caller is not None:
            on_caller_left(caller, deadline.hang_up)
        outgoing = None
        try:
            await self.served.admit(model)
            outgoing = self.outbox.enqueue(model, part, timeout_s)
            await outgoing.confirmed
            self.replies.confirmed(model, part, loop.time() + timeout_s)
            reply = await future
            self.served.heard_reply(model, reply)  # a restarting runtime's refusal
            return reply
        except asyncio.CancelledError:
            # Cancelled for its deadline or its caller's hang-up, and by nothing else (a
            # shutdown): as `asyncio.timeout` tells them apart.
            ours = deadline.expired + deadline.left
            if ours and deadline.task.cancelling() == ours:
                for _ in range(ours):
                    deadline.task.uncancel()
                if deadline.left:
                    raise self._released(part, outgoing) from None
                raise late(timeout_s) from None
            raise
        finally:
            deadline.finished = True
            if caller is not None:
                forget_caller(caller)
            self.replies.forget(task_id)

    def _released(self, part: Part, outgoing: _Outgoing | None) -> ShoalError:
        """A request whose caller hung up: revoked if it may have been published (a request
        still in the outbox is never published: its wait was cancelled)."""
        published = outgoing is not None and outgoing.taken
        CALLERS_LEFT.labels("published" if published else "outbox").inc()
        if published:
            self.revokes.revoke(part.task_id)
        return ShoalError(ErrorCode.CANCELLED, "the caller closed its connection before the "
                          "answer; the request was released")

    def stream(self, model: str, part: Part, timeout_s: float) -> AsyncIterator[dict]:
        """Publish a streamed request; iterate its PROGRESS states and then its result
        (`gateway.broker.streams.ReplyStreams.stream`)."""
        return self.streams.stream(model, part, timeout_s)

    async def cancel(self, task_ids: list[str]) -> bool:
        """Revoke requests on every worker (`gateway.broker.streams.ReplyStreams.cancel`);
        False if the broker did not take it."""
        return await self.streams.cancel(task_ids)

    async def publish_part(self, model: str, part: Part, timeout_s: float,
                           reply_to: str) -> None:
        """Publish one request alone, its result to `reply_to` (a job's part: its result
        goes to the jobs' shared reply queue, and nobody here awaits it); return once the
        broker has it. QUEUE_FULL or BROKER_UNAVAILABLE as for any request."""
        if not self._connected():
            raise unavailable("the message broker is not connected")
        await self.queues.declare(model)
        message = single_message(part, self.origin)
        await self.outbox.publish(model, message.task_id, message.body, message.headers,
                                  timeout_s, reply_to=reply_to)

    async def publish_parts(self, model: str, parts: list[Part], timeout_s: float,
                            reply_to: str) -> None:
        """Publish several requests of one model in one message (coalesced: each keeps its
        id, result and Flower task), their results to `reply_to`: an OpenAI batch's lines,
        so that a few messages, not hundreds, stand in the queue before a caller's."""
        if not self._connected():
            raise unavailable("the message broker is not connected")
        await self.queues.declare(model)
        message = coalesce(model, parts[0].annotations.op, parts, self.origin)
        await self.outbox.publish(model, message.task_id, message.body, message.headers,
                                  timeout_s, reply_to=reply_to)

    async def admit(self, model: str) -> None:
        """Refuse (503) a model no worker serves, as a request for it would be."""
        if not self.ready:
            raise unavailable("the message broker is not connected")
        await self.served.admit(model)

    async def consumer_count(self, model: str) -> int:
        """Consumers of the model's queue (`gateway.broker.queue_declarations`)."""
        return await self.queues.consumer_count(model)

    async def _send(self, model: str, part: Part, timeout_s: float) -> None:
        """Admit the model, put the request in its outbox; return once the broker has it."""
        await self.served.admit(model)
        await self.outbox.send(model, part, timeout_s)
