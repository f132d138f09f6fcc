"""Streamed requests, and revoking requests whose callers left.

A streamed request's PROGRESS states (its output so far, see
`app.worker.lifecycle.replies.Replier.progress`) arrive on the reply queue before its result and
go, with the result last, to the queue its caller reads (`stream`). A caller
that leaves revokes the request (`cancel`: Celery's broadcast control message,
`shoal_cancel`), so the worker stops generating for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aio_pika
import orjson

from gateway.broker.broker_errors import interrupted, late, unavailable
from gateway.broker.pool_view import PoolView
from gateway.broker.reply_futures import AwaitedReplies
from tasks.envelope import PROGRESS, Part

log = logging.getLogger(__name__)

# Celery's broadcast control exchange (`app.control`, namespace "celery"); a cancel is
# published there as `celery -A app control shoal_cancel` would.
CONTROL_EXCHANGE = "celery.pidbox"
CONTROL_EXPIRES_S = 10.0
# How often a stream that waits for its next chunk checks that its worker is still there.
STREAM_LIVENESS_S = 1.0


class ReplyStreams:
    """Streams of PROGRESS states and a result, and the cancels of requests left behind.

    `connected` says whether a request may be published now, `send` publishes one (its
    model admitted) and returns once the broker has it, `connection` is the broker
    connection (None before the first one) that cancels go out on."""

    def __init__(self, replies: AwaitedReplies, pool: PoolView, connected: Callable[[], bool],
                 send: Callable[[str, Part, float], Awaitable[None]],
                 connection: Callable[[], aio_pika.abc.AbstractConnection | None]) -> None:
        self.replies = replies
        self.pool = pool
        self._connected = connected
        self._send = send
        self._connection = connection
        self._control: aio_pika.abc.AbstractChannel | None = None
        self._background: set[asyncio.Task] = set()

    async def stream(self, model: str, part: Part, timeout_s: float) -> AsyncIterator[dict]:
        """Publish a streamed request; yield its PROGRESS states and then its result (the
        last item). DEADLINE_EXCEEDED when `timeout_s` runs out first. A caller that stops
        iterating before the result (a client that left) revokes the request.

        A stream whose worker left (its pool state went stale or said farewell) or whose
        request started over (the broker redelivered it to another worker, which streams
        from the beginning) ends with STREAM_INTERRUPTED: its caller has the first part,
        and would otherwise wait for the deadline or read it twice."""
        if not self._connected():
            raise unavailable("the message broker is not connected")
        loop = asyncio.get_running_loop()
        task_id = part.task_id
        self.replies.streams[task_id] = queue = asyncio.Queue()
        self.replies.unanswered[task_id] = (model, loop.time())
        deadline = loop.time() + timeout_s
        finished = False
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._send(model, part, timeout_s)
            except TimeoutError:
                raise late(timeout_s) from None
            self.replies.confirmed(model, part, deadline)
            worker: str | None = None
            tokens: dict[int, int] = {}
            while True:
                try:
                    async with asyncio.timeout_at(min(deadline,
                                                      loop.time() + STREAM_LIVENESS_S)):
                        result = await queue.get()
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise late(timeout_s) from None
                    if worker is not None and self.pool.gone(worker, time.monotonic()):
                        raise interrupted(f"its worker {worker} stopped") from None
                    continue
                finished = result.get("status") != PROGRESS
                if not finished:
                    worker = _progress(result, tokens) or worker
                yield result
                if finished:
                    return
        finally:
            self.replies.forget(task_id)
            if not finished:
                # Not awaited: a cancelled generator must not block; best effort.
                task = loop.create_task(self.cancel([task_id]))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def cancel(self, task_ids: list[str]) -> bool:
        """Revoke requests on every worker (Celery's broadcast `shoal_cancel`): one that has
        not started is answered CANCELLED, one that runs stops at its next token. False if
        the broker did not take it (no connection, or the publish failed): a caller that
        must have it taken sends it again (`gateway.jobs.part_revokes`)."""
        body = orjson.dumps({"method": "shoal_cancel", "arguments": {"task_ids": task_ids},
                             "destination": None, "pattern": None, "matcher": None})
        message = aio_pika.Message(
            body, content_type="application/json", content_encoding="utf-8",
            headers={"clock": 0, "expires": time.time() + CONTROL_EXPIRES_S},
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT)
        try:
            if self._control is None or self._control.is_closed:
                connection = self._connection()
                if connection is None:
                    return False
                self._control = await connection.channel(publisher_confirms=False)
            # Not declared: the workers' pidbox consumers declare it (a publish before any
            # worker ran closes this channel only; the next cancel opens another).
            exchange = await self._control.get_exchange(CONTROL_EXCHANGE, ensure=False)
            await exchange.publish(message, routing_key="")
        except Exception as exc:
            log.warning("could not revoke %s: %s", task_ids, exc)
            return False
        return True


def _progress(result: dict, tokens: dict[int, int]) -> str | None:
    """Check a PROGRESS state against the ones before (`tokens`: each item's count so far):
    the worker that sent it. STREAM_INTERRUPTED if the output started over."""
    meta = result.get("result") or {}
    for choice in meta.get("choices") or ():
        index, count = choice.get("index", 0), choice.get("tokens", 0)
        if count <= tokens.get(index, 0):
            raise interrupted("it was started over by another worker (its first worker "
                              "died and the broker redelivered it)")
        tokens[index] = count
    return meta.get("worker")
