"""The models' queues, declared lazily, and their consumer counts.

Queues are declared lazily, on the first request for a model, not at start:
a gateway serves every catalog model SHOAL_GATEWAY_MODELS allows (~30 with
the packaged catalog), and declaring them all would make the broker hold two
quorum queues (Raft groups) per catalog model and prefix whether anyone asks
for it or not (measured on this machine: 0.8 s for the 58 queues of 29 models
when they are new, 0.1 s when they exist, on every gateway start and
reconnect). The first request for a model pays its declaration (~15 ms per
new quorum queue, ~1 ms once it exists); the declaration also tells its
consumer count, which `gateway.broker.served_models` reads to decide whether
the model is served at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import aio_pika

from gateway.broker.broker_errors import unavailable
from tasks.settings import Settings
from tasks.topology import DEAD_LETTER_ARGUMENTS, QueueType, queue_for

log = logging.getLogger(__name__)

# How long a queue's consumer count is trusted when no pool state lists the model.
CONSUMERS_TTL_S = 1.0


class ModelQueues:
    """Each model's queue (and its dead-letter queue), declared by the first request that
    needs it, and how many consumers it had when last asked."""

    def __init__(self, settings: Settings, models: Mapping[str, QueueType | None]) -> None:
        """`models`: each model the gateway accepts, with its catalog entry's `queue_type`
        (None: SHOAL_QUEUE_TYPE), so that it declares the queue the workers declare."""
        self.queues = {m: queue_for(m, settings, queue_type) for m, queue_type in models.items()}
        # Queues are declared on their own channel, so that a refused declaration (a queue
        # that exists with other arguments) never closes the publishing channel.
        self._topology: aio_pika.abc.AbstractChannel | None = None
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._dead_exchange: aio_pika.abc.AbstractExchange | None = None
        self._declared: dict[str, asyncio.Task[aio_pika.abc.AbstractQueue]] = {}
        self._consumers: dict[str, tuple[int, float]] = {}  # model -> (count, monotonic at)
        self._probes: dict[str, asyncio.Task[int]] = {}

    def attach(self, topology: aio_pika.abc.AbstractChannel,
               exchange: aio_pika.abc.AbstractExchange,
               dead_exchange: aio_pika.abc.AbstractExchange) -> None:
        """The channel to declare on, and the exchanges a queue is bound to (once connected)."""
        self._topology, self._exchange, self._dead_exchange = topology, exchange, dead_exchange

    def is_declared(self, model: str) -> bool:
        declared = self._declared.get(model)  # a failed declaration is not kept
        return declared is not None and declared.done()

    def forget(self, model: str) -> None:
        """The queue was deleted behind our back: the next request declares it again."""
        self._declared.pop(model, None)

    async def declare(self, model: str) -> aio_pika.abc.AbstractQueue:
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
            raise unavailable("the message broker is not connected")
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
            raise unavailable(f"the broker refused the queue of {model}: {exc}") from None
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
        queue = await self.declare(model)
        try:
            # A re-declaration with the same arguments (a queue someone deleted comes back
            # unbound: its next publish is unroutable and the request after it re-binds).
            ok = await queue.declare()
        except Exception as exc:
            self._declared.pop(model, None)
            raise unavailable(f"cannot read the queue of {model}: {exc}") from None
        count = ok.consumer_count or 0
        self._consumers[model] = (count, time.monotonic())
        return count
