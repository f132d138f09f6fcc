"""The gateway's link to RabbitMQ: declare, publish with confirms, await replies.

One robust connection with two channels: one publishes with publisher
confirms (a nack from a full queue becomes 429), the other consumes this
gateway's exclusive reply queue, whose messages resolve futures keyed by
correlation id. A reply for an id nobody waits for (a duplicate after a
redelivery, or a request that already timed out) is dropped.

Requests are not published one message each under load. Each model has an
outbox: a request goes out on the loop's next turn, alone when it is alone
(a plain Celery message), and while `publishes_in_flight` publishes of its
model await their confirms, the requests that arrive meanwhile wait and go
out together as one coalesced message (`tasks.envelope.coalesce`). No timer
is involved: an idle gateway publishes at once, a busy one sends fewer,
fuller messages, and the broker and the worker handle one message for many
requests.

Queues are declared lazily, on the first request for a model, not at start:
a gateway serves every catalog model SHOAL_GATEWAY_MODELS allows (~30 with
the packaged catalog), and declaring them all would make the broker hold two
quorum queues (Raft groups) per catalog model and prefix whether anyone asks
for it or not (measured on this machine: 0.8 s for the 58 queues of 29 models
when they are new, 0.1 s when they exist, on every gateway start and
reconnect). The first request for a model pays its declaration (~15 ms per
new quorum queue, ~1 ms once it exists); the declaration also tells its
consumer count, which decides whether the model is served at all:

A request for a model that no worker serves is refused at once with 503
MODEL_UNAVAILABLE when SHOAL_GATEWAY_UNSERVED=refuse (the default), or
published to wait for a worker until its deadline with `wait` (scale-to-zero,
where an autoscaler starts a worker on queue depth). "Served" is decided
without a broker round trip per request: a model is served if a fresh pool
state (`gateway.broker.pool_view`, from the workers' fanout exchange) lists it in any
state; otherwise if its queue has a consumer, read from a queue.declare-ok
at most `CONSUMERS_TTL_S` old (a shoal worker that has not announced itself
yet, or any other consumer such as a plain Celery worker). A gateway that
just started, and has heard no pool state, therefore never refuses a model
that a worker consumes. A worker that died stays "serving" until its pool
state goes stale (STALE_AFTER_INTERVALS of its interval) or, if it sent
none, for up to `CONSUMERS_TTL_S`; requests sent meanwhile wait for another
worker or their deadline, as before.

Streams: a streamed request's PROGRESS states (its output so far, see
`app.replies.Replier.progress`) arrive on the reply queue before its result and
go, with the result last, to the queue its caller reads (`stream`). A caller
that leaves revokes the request (`cancel`: Celery's broadcast control message,
`shoal_cancel`), so the worker stops generating for it.

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
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aio_pika
import orjson
from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import DeliveryError, PublishError
from pamqp.commands import Basic

from gateway.broker.failover import FailoverConnection, connect_failover
from gateway.broker.pool_view import PoolView
from gateway.edge.api_errors import ApiError
from gateway.edge.gateway_metrics import (
    DUPLICATE_REPLIES,
    OLDEST_WAITING,
    POOL_STATES,
    REQUESTS_PER_MESSAGE,
)
from tasks.broker_metrics import gateway_link
from tasks.broker_urls import split_urls
from tasks.envelope import (
    CONTENT_ENCODING,
    CONTENT_TYPE,
    H_MULTI,
    PROGRESS,
    Part,
    coalesce,
    decode_results,
    single_message,
)
from tasks.errors import ErrorCode
from tasks.pool_state import pool_exchange
from tasks.settings import Settings
from tasks.topology import DEAD_LETTER_ARGUMENTS, dead_letter_exchange, queue_for, task_exchange

log = logging.getLogger(__name__)

# A coalesced message carries at most this many requests and body bytes; a request
# bigger than COALESCE_MAX_PART_BYTES (an image, a long document) goes alone.
COALESCE_MAX_PARTS = 256
COALESCE_MAX_BYTES = 1024 * 1024
COALESCE_MAX_PART_BYTES = 64 * 1024
# How long a queue's consumer count is trusted when no pool state lists the model.
CONSUMERS_TTL_S = 1.0
# Celery's broadcast control exchange (`app.control`, namespace "celery"); a cancel is
# published there as `celery -A app control shoal_cancel` would.
CONTROL_EXCHANGE = "celery.pidbox"
CONTROL_EXPIRES_S = 10.0
# How often a stream that waits for its next chunk checks that its worker is still there.
STREAM_LIVENESS_S = 1.0
# How often shoal_gateway_oldest_waiting_seconds is brought up to date.
AGE_REPORT_S = 1.0


@dataclass(slots=True)
class _Outgoing:
    """A request waiting in its model's outbox, and the future its caller awaits until
    the broker has confirmed it."""

    part: Part
    timeout_s: float
    confirmed: asyncio.Future[None]


@dataclass(slots=True)
class _Awaited:
    """A request whose publish the broker confirmed and whose result is awaited: what it
    takes to publish it again after a reconnect."""

    model: str
    part: Part
    deadline: float  # loop time


class Broker:
    def __init__(self, settings: Settings, models: list[str]) -> None:
        self.settings = settings
        self.models = models
        self.queues = {m: queue_for(m, settings) for m in models}
        tag = uuid.uuid4().hex
        self.reply_to = f"{settings.queue_prefix}.reply.{tag}"
        # This gateway's copy of the workers' pool states (exclusive, bound to the fanout).
        self.pool_queue = f"{settings.queue_prefix}.pool.{tag}"
        self.pool = PoolView(settings.pool_state_interval_s)
        self.origin = f"gateway@{socket.gethostname()}:{os.getpid()}"
        self.pending: dict[str, asyncio.Future] = {}
        # Streamed requests: their PROGRESS states, then their result (which ends the entry).
        self.streams: dict[str, asyncio.Queue[dict]] = {}
        self._control: aio_pika.abc.AbstractChannel | None = None
        self._background: set[asyncio.Task] = set()
        self._outbox: dict[str, list[_Outgoing]] = {}
        self._in_flight: defaultdict[str, int] = defaultdict(int)
        self._flush_due: set[str] = set()
        self._connection: FailoverConnection | None = None
        self.urls = split_urls(settings.broker_url)
        self.link = gateway_link()
        # Confirmed requests awaiting their result, and those of them that were awaited when
        # the connection dropped (published again once it is back; see the module's doc).
        self._awaited: dict[str, _Awaited] = {}
        self._orphaned: set[str] = set()
        # Requests with nothing answered yet: task id -> (model, loop time it came in).
        self._unanswered: dict[str, tuple[str, float]] = {}
        self._age_reporter: asyncio.Task | None = None
        self._link_up = False
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._dead_exchange: aio_pika.abc.AbstractExchange | None = None
        # Queues are declared on their own channel, so that a refused declaration (a queue
        # that exists with other arguments) never closes the publishing channel.
        self._topology: aio_pika.abc.AbstractChannel | None = None
        self._declared: dict[str, asyncio.Task[aio_pika.abc.AbstractQueue]] = {}
        self._consumers: dict[str, tuple[int, float]] = {}  # model -> (count, monotonic at)
        self._probes: dict[str, asyncio.Task[int]] = {}
        self._ready = False
        self._task: asyncio.Task | None = None
        # Called with the connection once it is up (the jobs' shared reply consumer); a
        # robust connection restores what they declare and consume after a reconnect.
        self.on_connect: list[Callable[[aio_pika.abc.AbstractRobustConnection],
                                       Awaitable[None]]] = []

    @property
    def ready(self) -> bool:
        conn = self._connection
        return (self._ready and self._link_up and conn is not None and not conn.is_closed
                and conn.connected.is_set())

    def start(self) -> None:
        """Connect in the background, retrying until the broker answers."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._connect_forever())
        self._age_reporter = loop.create_task(self._report_oldest_waiting())

    def oldest_waiting(self, now: float) -> dict[str, float]:
        """Per model, seconds since the oldest request with nothing answered came in."""
        oldest: dict[str, float] = {}
        for model, since in self._unanswered.values():
            oldest[model] = max(oldest.get(model, 0.0), now - since)
        return oldest

    async def _report_oldest_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ages = self.oldest_waiting(loop.time())
            for model in {*self.models, *ages}:
                OLDEST_WAITING.labels(model).set(round(ages.get(model, 0.0), 3))
            await asyncio.sleep(AGE_REPORT_S)

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
            self._topology = await connection.channel(publisher_confirms=False)
            self._dead_exchange = await self._topology.declare_exchange(
                dead_letter_exchange(prefix), aio_pika.ExchangeType.DIRECT, durable=True)
            reply_channel = await connection.channel(publisher_confirms=False)
            reply_queue = await reply_channel.declare_queue(
                self.reply_to, exclusive=True, auto_delete=True
            )
            await reply_queue.consume(self._on_reply, no_ack=True)
        except Exception:
            await connection.close()
            raise
        await self._subscribe_pool(connection)
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
        self._orphaned.update(self._awaited)
        self.link.lost(repr(exc))

    def _on_link_back(self, connection: FailoverConnection) -> None:
        # Called once the robust connection has restored every channel, queue and consumer
        # (the reply queue among them) on the node it reached.
        self._link_up = True
        self.link.connected(connection.endpoint)
        orphaned, self._orphaned = self._orphaned, set()
        again = [(task_id, a) for task_id in orphaned if (a := self._awaited.get(task_id))]
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
                lambda done, task_id=task_id: self._republished(task_id, done))
            self._outbox.setdefault(awaited.model, []).append(outgoing)
            self._schedule_flush(awaited.model)

    def _republished(self, task_id: str, confirmed: asyncio.Future[None]) -> None:
        if confirmed.cancelled() or confirmed.exception() is None:
            return
        # Refused (queue full) or the connection dropped again before the confirm: answer
        # the caller with that retryable error rather than let it wait for its deadline.
        waiting = self.pending.get(task_id)
        if waiting is not None and not waiting.done():
            waiting.set_exception(confirmed.exception())
            return
        stream = self.streams.get(task_id)
        if stream is not None:
            self._orphaned.add(task_id)  # a stream cannot take an exception: try once more

    async def _subscribe_pool(self, connection: aio_pika.abc.AbstractRobustConnection) -> None:
        """Receive the workers' pool states. Without them the gateway still works (the
        consumer counts decide what is served; /v1/models shows no workers), so a failure
        here is logged, not fatal."""
        try:
            channel = await connection.channel(publisher_confirms=False)
            exchange = await channel.declare_exchange(
                pool_exchange(self.settings.queue_prefix), aio_pika.ExchangeType.FANOUT,
                durable=True)
            queue = await channel.declare_queue(self.pool_queue, exclusive=True,
                                                auto_delete=True)
            await queue.bind(exchange)
            await queue.consume(self._on_pool_state, no_ack=True)
        except Exception:
            log.exception("cannot subscribe to the workers' pool states on %s; /v1/models "
                          "will not say where models are loaded",
                          pool_exchange(self.settings.queue_prefix))

    def _on_pool_state(self, message: AbstractIncomingMessage) -> None:
        try:
            self.pool.update(message.body, time.monotonic())
        except Exception as exc:  # a malformed state must not kill the consumer
            POOL_STATES.labels("dropped").inc()
            log.warning("malformed pool state dropped (%d bytes): %s", len(message.body), exc)
        else:
            POOL_STATES.labels("kept").inc()

    async def close(self) -> None:
        for task in (self._task, self._age_reporter):
            if task is not None:
                task.cancel()
        self._link_up = False  # closing is no outage
        if self._connection is not None:
            await self._connection.close()
        for future in self.pending.values():
            future.cancel()

    def _on_reply(self, message: AbstractIncomingMessage) -> None:
        try:
            results = decode_results(message.body, bool(message.headers.get(H_MULTI)))
        except Exception:  # a malformed reply must not kill the consumer
            log.exception("undecodable reply dropped")
            return
        for result in results:
            task_id = result.get("task_id") or message.correlation_id or ""
            stream = self.streams.get(task_id)
            if result.get("status") == PROGRESS:
                self._unanswered.pop(task_id, None)  # its stream has begun
                if stream is not None:
                    stream.put_nowait(result)
                continue  # a stream nobody reads any more
            if stream is not None:
                del self.streams[task_id]  # a duplicate of the result finds nobody
                stream.put_nowait(result)
                continue
            future = self.pending.get(task_id)
            if future is None or future.done():
                DUPLICATE_REPLIES.inc()
            else:
                future.set_result(result)

    async def submit(self, model: str, part: Part, timeout_s: float) -> dict:
        """Publish a request (alone or coalesced with others waiting for the same model)
        and wait for its result until `timeout_s` runs out. 503 MODEL_UNAVAILABLE at once
        for a model no worker serves, unless SHOAL_GATEWAY_UNSERVED=wait."""
        if not self.ready or self._exchange is None:
            raise _unavailable("the message broker is not connected")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        task_id = part.task_id
        self.pending[task_id] = future
        self._unanswered[task_id] = (model, loop.time())
        try:
            async with asyncio.timeout(timeout_s):
                await self._send(model, part, timeout_s)
                self._awaited[task_id] = _Awaited(model, part, loop.time() + timeout_s)
                return await future
        except TimeoutError:
            raise _late(timeout_s) from None
        finally:
            self.pending.pop(task_id, None)
            self._awaited.pop(task_id, None)
            self._unanswered.pop(task_id, None)

    async def stream(self, model: str, part: Part, timeout_s: float) -> AsyncIterator[dict]:
        """Publish a streamed request; yield its PROGRESS states and then its result (the
        last item). DEADLINE_EXCEEDED when `timeout_s` runs out first. A caller that stops
        iterating before the result (a client that left) revokes the request.

        A stream whose worker left (its pool state went stale or said farewell) or whose
        request started over (the broker redelivered it to another worker, which streams
        from the beginning) ends with STREAM_INTERRUPTED: its caller has the first part,
        and would otherwise wait for the deadline or read it twice."""
        if not self.ready or self._exchange is None:
            raise _unavailable("the message broker is not connected")
        loop = asyncio.get_running_loop()
        task_id = part.task_id
        self.streams[task_id] = queue = asyncio.Queue()
        self._unanswered[task_id] = (model, loop.time())
        deadline = loop.time() + timeout_s
        finished = False
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._send(model, part, timeout_s)
            except TimeoutError:
                raise _late(timeout_s) from None
            self._awaited[task_id] = _Awaited(model, part, deadline)
            worker: str | None = None
            tokens: dict[int, int] = {}
            while True:
                try:
                    async with asyncio.timeout_at(min(deadline,
                                                      loop.time() + STREAM_LIVENESS_S)):
                        result = await queue.get()
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise _late(timeout_s) from None
                    if worker is not None and self.pool.gone(worker, time.monotonic()):
                        raise _interrupted(f"its worker {worker} stopped") from None
                    continue
                finished = result.get("status") != PROGRESS
                if not finished:
                    worker = _progress(result, tokens) or worker
                yield result
                if finished:
                    return
        finally:
            self.streams.pop(task_id, None)
            self._awaited.pop(task_id, None)
            self._unanswered.pop(task_id, None)
            if not finished:
                # Not awaited: a cancelled generator must not block; best effort.
                task = loop.create_task(self.cancel([task_id]))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def cancel(self, task_ids: list[str]) -> None:
        """Revoke requests on every worker (Celery's broadcast `shoal_cancel`): one that has
        not started is answered CANCELLED, one that runs stops at its next token."""
        body = orjson.dumps({"method": "shoal_cancel", "arguments": {"task_ids": task_ids},
                             "destination": None, "pattern": None, "matcher": None})
        message = aio_pika.Message(
            body, content_type="application/json", content_encoding="utf-8",
            headers={"clock": 0, "expires": time.time() + CONTROL_EXPIRES_S},
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT)
        try:
            if self._control is None or self._control.is_closed:
                if self._connection is None:
                    return
                self._control = await self._connection.channel(publisher_confirms=False)
            # Not declared: the workers' pidbox consumers declare it (a publish before any
            # worker ran closes this channel only; the next cancel opens another).
            exchange = await self._control.get_exchange(CONTROL_EXCHANGE, ensure=False)
            await exchange.publish(message, routing_key="")
        except Exception as exc:
            log.warning("could not revoke %s: %s", task_ids, exc)

    async def publish_part(self, model: str, part: Part, timeout_s: float,
                           reply_to: str) -> None:
        """Publish one request alone, its result to `reply_to` (a job's part: its result
        goes to the jobs' shared reply queue, and nobody here awaits it); return once the
        broker has it. QUEUE_FULL or BROKER_UNAVAILABLE as for any request."""
        if not self.ready or self._exchange is None:
            raise _unavailable("the message broker is not connected")
        await self._queue(model)
        message = single_message(part, self.origin)
        await self._publish(model, message.task_id, message.body, message.headers, timeout_s,
                            reply_to=reply_to)

    async def admit(self, model: str) -> None:
        """Refuse (503) a model no worker serves, as a request for it would be."""
        if not self.ready:
            raise _unavailable("the message broker is not connected")
        await self._admit(model)

    async def _send(self, model: str, part: Part, timeout_s: float) -> None:
        """Admit the model, put the request in its outbox; return once the broker has it."""
        await self._admit(model)
        outgoing = _Outgoing(part, timeout_s, asyncio.get_running_loop().create_future())
        self._outbox.setdefault(model, []).append(outgoing)
        self._schedule_flush(model)
        await outgoing.confirmed

    # --- queues, and whether a worker serves them -----------------------------------------

    async def _admit(self, model: str) -> None:
        """Make sure the model's queue exists; refuse a model no worker serves (see the
        module's docstring)."""
        declared = self._declared.get(model)  # a failed declaration is not kept
        if declared is None or not declared.done():
            await self._queue(model)
        if self.settings.gateway_unserved == "wait":
            return
        if self.pool.serves(model, time.monotonic()):
            return
        if await self.consumer_count(model) == 0:
            raise ApiError(
                ErrorCode.MODEL_UNAVAILABLE,
                f"no worker serves {model} now (none consumes its queue "
                f"{self.queues[model].name}); retry later. A gateway with "
                "SHOAL_GATEWAY_UNSERVED=wait queues such requests until a worker starts or "
                "their deadline passes (for deployments that scale workers to zero).",
                retry_after=self.settings.retry_after_s,
            )

    async def _queue(self, model: str) -> aio_pika.abc.AbstractQueue:
        """The model's queue, declared (with its dead-letter queue) by the first request
        that needs it; requests that arrive meanwhile share that declaration."""
        declared = self._declared.get(model)
        if declared is None:
            declared = asyncio.get_running_loop().create_task(self._declare(model))
            self._declared[model] = declared
            declared.add_done_callback(lambda t: self._declaration_done(model, t))
        return await asyncio.shield(declared)

    def _declaration_done(self, model: str, declared: asyncio.Task) -> None:
        if (declared.cancelled() or declared.exception() is not None) \
                and self._declared.get(model) is declared:
            del self._declared[model]  # the next request tries again

    async def _declare(self, model: str) -> aio_pika.abc.AbstractQueue:
        if self._topology is None or self._exchange is None or self._dead_exchange is None:
            raise _unavailable("the message broker is not connected")
        mq = self.queues[model]
        try:
            queue = await self._topology.declare_queue(mq.name, durable=True,
                                                       arguments=mq.arguments)
            await queue.bind(self._exchange, routing_key=mq.name)
            dead = await self._topology.declare_queue(
                mq.dead_letter_queue, durable=True, arguments=DEAD_LETTER_ARGUMENTS)
            await dead.bind(self._dead_exchange, routing_key=mq.name)
        except Exception as exc:  # refused (other arguments), or the connection dropped
            log.warning("cannot declare the queue of %s: %s", model, exc)
            raise _unavailable(f"the broker refused the queue of {model}: {exc}") from None
        result = queue.declaration_result
        if result is not None:
            self._consumers[model] = (result.consumer_count or 0, time.monotonic())
        return queue

    async def consumer_count(self, model: str) -> int:
        """Consumers of the model's queue, read from a declare-ok at most CONSUMERS_TTL_S
        old; concurrent callers share one re-declaration."""
        cached = self._consumers.get(model)
        if cached is not None and time.monotonic() - cached[1] < CONSUMERS_TTL_S:
            return cached[0]
        probe = self._probes.get(model)
        if probe is None:
            probe = asyncio.get_running_loop().create_task(self._probe(model))
            self._probes[model] = probe
            probe.add_done_callback(lambda t: self._probed(model, t))
        return await asyncio.shield(probe)

    def _probed(self, model: str, probe: asyncio.Task[int]) -> None:
        self._probes.pop(model, None)
        if not probe.cancelled():
            probe.exception()  # retrieved: every caller may have given up waiting

    async def _probe(self, model: str) -> int:
        queue = await self._queue(model)
        try:
            # A re-declaration with the same arguments (a queue someone deleted comes back
            # unbound: its next publish is unroutable and the request after it re-binds).
            ok = await queue.declare()
        except Exception as exc:
            self._declared.pop(model, None)
            raise _unavailable(f"cannot read the queue of {model}: {exc}") from None
        count = ok.consumer_count or 0
        self._consumers[model] = (count, time.monotonic())
        return count

    # --- the outbox ----------------------------------------------------------------------

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
                await self._publish(model, message.task_id, message.body, message.headers,
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

    async def _publish(
        self, model: str, task_id: str, body: bytes, headers: dict, timeout_s: float,
        reply_to: str | None = None,
    ) -> None:
        assert self._exchange is not None
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
            await self._exchange.publish(
                message, routing_key=self.queues[model].name, mandatory=True
            )
        except PublishError:
            # Deleted behind our back: the next request declares it again.
            self._declared.pop(model, None)
            raise _unavailable(f"the queue of {model} does not exist on the broker") from None
        except DeliveryError as exc:
            if isinstance(exc.frame, Basic.Nack):
                raise ApiError(
                    ErrorCode.QUEUE_FULL,
                    f"the queue of {model} is full; retry later",
                    retry_after=self.settings.retry_after_s,
                ) from None
            raise _unavailable(f"the broker did not take the message: {exc}") from None
        except (aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            raise _unavailable(f"the message broker is not reachable: {exc}") from None
        except asyncio.CancelledError:
            # The connection dropped with the confirm outstanding (aiormq cancels what
            # awaits it): the message may or may not be queued; the caller may retry.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise _unavailable("the broker connection dropped before the broker confirmed "
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


def _progress(result: dict, tokens: dict[int, int]) -> str | None:
    """Check a PROGRESS state against the ones before (`tokens`: each item's count so far):
    the worker that sent it. STREAM_INTERRUPTED if the output started over."""
    meta = result.get("result") or {}
    for choice in meta.get("choices") or ():
        index, count = choice.get("index", 0), choice.get("tokens", 0)
        if count <= tokens.get(index, 0):
            raise _interrupted("it was started over by another worker (its first worker "
                               "died and the broker redelivered it)")
        tokens[index] = count
    return meta.get("worker")


def _interrupted(why: str) -> ApiError:
    return ApiError(ErrorCode.STREAM_INTERRUPTED,
                    f"the stream was interrupted: {why}; the output so far stands, the rest "
                    "will not come (retry the request)", retry_after=1)


def _late(timeout_s: float) -> ApiError:
    return ApiError(
        ErrorCode.DEADLINE_EXCEEDED,
        f"no result within the request's {timeout_s * 1000:.0f} ms deadline "
        "(X-Timeout-Ms); the workers may be busy or absent",
    )


def _unavailable(message: str) -> ApiError:
    return ApiError(ErrorCode.BROKER_UNAVAILABLE, message, retry_after=1)
