"""The gateway's link to RabbitMQ: declare, publish with confirms, await replies.

One robust connection with two channels: one publishes with publisher
confirms (a nack from a full queue becomes 429), the other consumes this
gateway's exclusive reply queue, whose messages resolve futures keyed by
correlation id. A reply for an id nobody waits for (a duplicate after a
redelivery, or a request that already timed out) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import DeliveryError, PublishError
from pamqp.commands import Basic

from app.settings import Settings
from app.topology import DEAD_LETTER_ARGUMENTS, dead_letter_exchange, queue_for, task_exchange
from gateway.errors import ApiError
from gateway.metrics import DUPLICATE_REPLIES
from tasks.envelope import CONTENT_ENCODING, CONTENT_TYPE, H_MULTI, decode_results
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)


class Broker:
    def __init__(self, settings: Settings, models: list[str]) -> None:
        self.settings = settings
        self.models = models
        self.queues = {m: queue_for(m, settings) for m in models}
        self.reply_to = f"{settings.queue_prefix}.reply.{uuid.uuid4().hex}"
        self.origin = f"gateway@{socket.gethostname()}:{os.getpid()}"
        self.pending: dict[str, asyncio.Future] = {}
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._ready = False
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        conn = self._connection
        return self._ready and conn is not None and not conn.is_closed and conn.connected.is_set()

    def start(self) -> None:
        """Connect in the background, retrying until the broker answers."""
        self._task = asyncio.get_running_loop().create_task(self._connect_forever())

    async def _connect_forever(self) -> None:
        delay = 0.2
        while True:
            try:
                await self._connect()
                return
            except Exception as exc:
                log.warning("broker not reachable (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _connect(self) -> None:
        connection = await aio_pika.connect_robust(
            self.settings.broker_url,
            heartbeat=int(self.settings.broker_heartbeat),
            client_properties={"connection_name": self.origin},
        )
        try:
            publish_channel = await connection.channel(publisher_confirms=True,
                                                       on_return_raises=True)
            self._exchange = await self._declare(publish_channel)
            reply_channel = await connection.channel(publisher_confirms=False)
            reply_queue = await reply_channel.declare_queue(
                self.reply_to, exclusive=True, auto_delete=True
            )
            await reply_queue.consume(self._on_reply, no_ack=True)
        except Exception:
            await connection.close()
            raise
        self._connection = connection
        self._ready = True
        log.info("gateway connected; replies on %s", self.reply_to)

    async def _declare(self, channel: aio_pika.abc.AbstractChannel) -> Any:
        prefix = self.settings.queue_prefix
        exchange = await channel.declare_exchange(
            task_exchange(prefix), aio_pika.ExchangeType.DIRECT, durable=True
        )
        dlx = await channel.declare_exchange(
            dead_letter_exchange(prefix), aio_pika.ExchangeType.DIRECT, durable=True
        )
        for mq in self.queues.values():
            queue = await channel.declare_queue(mq.name, durable=True, arguments=mq.arguments)
            await queue.bind(exchange, routing_key=mq.name)
            dead = await channel.declare_queue(
                mq.dead_letter_queue, durable=True, arguments=DEAD_LETTER_ARGUMENTS
            )
            await dead.bind(dlx, routing_key=mq.name)
        return exchange

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
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
            future = self.pending.get(result.get("task_id") or message.correlation_id or "")
            if future is None or future.done():
                DUPLICATE_REPLIES.inc()
            else:
                future.set_result(result)

    async def call(
        self, model: str, task_id: str, body: bytes, headers: dict, timeout_s: float
    ) -> dict:
        """Publish one task and wait for its result until `timeout_s` runs out."""
        if not self.ready or self._exchange is None:
            raise _unavailable("the message broker is not connected")
        future = asyncio.get_running_loop().create_future()
        self.pending[task_id] = future
        try:
            async with asyncio.timeout(timeout_s):
                await self._publish(model, task_id, body, headers, timeout_s)
                return await future
        except TimeoutError:
            raise ApiError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"no result within the request's {timeout_s * 1000:.0f} ms deadline "
                "(X-Timeout-Ms); the workers may be busy or absent",
            ) from None
        finally:
            self.pending.pop(task_id, None)

    async def _publish(
        self, model: str, task_id: str, body: bytes, headers: dict, timeout_s: float
    ) -> None:
        assert self._exchange is not None
        message = aio_pika.Message(
            body,
            headers=headers,
            content_type=CONTENT_TYPE,
            content_encoding=CONTENT_ENCODING,
            correlation_id=task_id,
            reply_to=self.reply_to,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            expiration=max(timeout_s, 0.001),
        )
        try:
            await self._exchange.publish(
                message, routing_key=self.queues[model].name, mandatory=True
            )
        except PublishError:
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


def _unavailable(message: str) -> ApiError:
    return ApiError(ErrorCode.BROKER_UNAVAILABLE, message, retry_after=1)
