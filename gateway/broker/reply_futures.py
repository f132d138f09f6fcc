"""The results this gateway awaits: futures keyed by correlation (task) id.

This gateway's exclusive reply queue delivers every result here (`on_reply`): a
request's result resolves the future its caller awaits; a streamed request's PROGRESS
states, then its result, go to the queue its stream reads. A reply for an id nobody
waits for (a duplicate after a redelivery, or a request that already timed out) is
dropped. What was confirmed and is still awaited is kept, so that it can be published
again after a failover (`gateway.broker.link`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage

from gateway.edge.gateway_metrics import DUPLICATE_REPLIES, OLDEST_WAITING
from tasks.envelope import H_MULTI, PROGRESS, Part, decode_results

log = logging.getLogger(__name__)

# How often shoal_gateway_oldest_waiting_seconds is brought up to date.
AGE_REPORT_S = 1.0


@dataclass(slots=True)
class _Awaited:
    """A request whose publish the broker confirmed and whose result is awaited: what it
    takes to publish it again after a reconnect."""

    model: str
    part: Part
    deadline: float  # loop time


class AwaitedReplies:
    """Who waits for which result, and what to publish again after a failover."""

    def __init__(self) -> None:
        self.pending: dict[str, asyncio.Future] = {}
        # Streamed requests: their PROGRESS states, then their result (which ends the entry).
        self.streams: dict[str, asyncio.Queue[dict]] = {}
        # Confirmed requests awaiting their result, and those of them that were awaited when
        # the connection dropped (published again once it is back; see gateway.broker.link).
        self.awaited: dict[str, _Awaited] = {}
        self.orphaned: set[str] = set()
        # Requests with nothing answered yet: task id -> (model, loop time it came in).
        self.unanswered: dict[str, tuple[str, float]] = {}

    def confirmed(self, model: str, part: Part, deadline: float) -> None:
        """The broker has the request: await its result (and publish it again after a
        failover) until `deadline` (loop time)."""
        self.awaited[part.task_id] = _Awaited(model, part, deadline)

    def forget(self, task_id: str) -> None:
        """Nobody waits for it any more (answered, timed out, or its caller left)."""
        self.pending.pop(task_id, None)
        self.streams.pop(task_id, None)
        self.awaited.pop(task_id, None)
        self.unanswered.pop(task_id, None)

    def oldest_waiting(self, now: float) -> dict[str, float]:
        """Per model, seconds since the oldest request with nothing answered came in."""
        oldest: dict[str, float] = {}
        for model, since in self.unanswered.values():
            oldest[model] = max(oldest.get(model, 0.0), now - since)
        return oldest

    async def report_oldest_waiting(self, models: list[str]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ages = self.oldest_waiting(loop.time())
            for model in {*models, *ages}:
                OLDEST_WAITING.labels(model).set(round(ages.get(model, 0.0), 3))
            await asyncio.sleep(AGE_REPORT_S)

    def on_reply(self, message: AbstractIncomingMessage) -> None:
        try:
            results = decode_results(message.body, bool(message.headers.get(H_MULTI)))
        except Exception:  # a malformed reply must not kill the consumer
            log.exception("undecodable reply dropped")
            return
        for result in results:
            task_id = result.get("task_id") or message.correlation_id or ""
            stream = self.streams.get(task_id)
            if result.get("status") == PROGRESS:
                self.unanswered.pop(task_id, None)  # its stream has begun
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

    def orphan_awaited(self) -> None:
        """The connection dropped: every awaited reply may have gone with its node."""
        self.orphaned.update(self.awaited)

    def take_orphaned(self) -> list[tuple[str, _Awaited]]:
        """The orphaned requests still awaited, to publish again (and forget as orphans)."""
        orphaned, self.orphaned = self.orphaned, set()
        return [(task_id, a) for task_id in orphaned if (a := self.awaited.get(task_id))]

    def republished(self, task_id: str, confirmed: asyncio.Future[None]) -> None:
        """A request published again after a failover was confirmed, or not."""
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
            self.orphaned.add(task_id)  # a stream cannot take an exception: try once more

    def cancel_all(self) -> None:
        for future in self.pending.values():
            future.cancel()
