"""Whether a worker serves a model, decided without a broker round trip per request.

A request for a model that no worker serves is refused at once with 503
MODEL_UNAVAILABLE when SHOAL_GATEWAY_UNSERVED=refuse (the default), or
published to wait for a worker until its deadline with `wait` (scale-to-zero,
where an autoscaler starts a worker on queue depth). A model is served if a fresh
pool state (`gateway.broker.pool_view`, from the workers' fanout exchange, subscribed
here) lists it in any state; otherwise if its queue has a consumer, read from a
queue.declare-ok at most `CONSUMERS_TTL_S` old (`gateway.broker.queue_declarations`:
a shoal worker that has not announced itself yet, or any other consumer such as a
plain Celery worker). A gateway that just started, and has heard no pool state,
therefore never refuses a model that a worker consumes. A worker that died stays
"serving" until its pool state goes stale (STALE_AFTER_INTERVALS of its interval) or,
if it sent none, for up to `CONSUMERS_TTL_S`; requests sent meanwhile wait for another
worker or their deadline, as before.

A model served only by workers whose runtime is restarting (`gateway.broker.
restarting_models`: their pool states say so, or the one worker serving it refused a
request MODEL_UNAVAILABLE with a Retry-After) is refused here, 503 MODEL_UNAVAILABLE
with the seconds until the soonest should serve as Retry-After, instead of being
published for a worker to refuse; it is published again once one says it serves, or
when that time has passed. Each such refusal is held up to RESTART_HOLD_S first, so that
clients retrying at once do not spin (a request whose model serves again meanwhile is
published).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from gateway.broker.pool_view import PoolView
from gateway.broker.queue_declarations import ModelQueues
from gateway.broker.restarting_models import RestartingModels
from gateway.edge.api_errors import ApiError
from gateway.edge.gateway_metrics import POOL_STATES
from tasks.envelope import SUCCESS
from tasks.errors import ErrorCode
from tasks.pool_state import pool_exchange
from tasks.settings import Settings

log = logging.getLogger(__name__)

# How long the gateway holds a request it will refuse because the model is restarting
# everywhere (less if the model should serve sooner): a client that retries at once then
# sends one request a second, not hundreds (measured: ~890 refusals a second from 4 such
# clients without the hold), and a request held when the model comes back is published.
RESTART_HOLD_S = 1.0


class ServedModels:
    """The workers' pool states as this gateway heard them (`pool`), and the admission
    of a request's model by them and by its queue's consumers."""

    def __init__(self, settings: Settings, queues: ModelQueues, pool_queue: str) -> None:
        self.settings = settings
        self.queues = queues
        # This gateway's copy of the workers' pool states (exclusive, bound to the fanout).
        self.pool_queue = pool_queue
        self.pool = PoolView(settings.pool_state_interval_s)
        self.restarting = RestartingModels()

    async def subscribe(self, connection: aio_pika.abc.AbstractRobustConnection) -> None:
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
            state = self.pool.update(message.body, time.monotonic())
        except Exception as exc:  # a malformed state must not kill the consumer
            POOL_STATES.labels("dropped").inc()
            log.warning("malformed pool state dropped (%d bytes): %s", len(message.body), exc)
        else:
            POOL_STATES.labels("kept").inc()
            self.restarting.heard_state(state)

    def heard_reply(self, model: str, reply: dict[str, Any]) -> None:
        """A request's reply: a refusal by a restarting runtime (MODEL_UNAVAILABLE with a
        Retry-After) may mark its worker restarting (`RestartingModels.heard_refusal`).
        While another worker serves the model, the refusal's Retry-After becomes 1 s (in
        `reply`): its caller's retry may reach that worker now, rather than wait for the
        refusing one's restart."""
        if reply.get("status") == SUCCESS:
            return
        meta = reply.get("result")
        if not isinstance(meta, dict):
            return
        args, retry_after = meta.get("exc_message"), meta.get("retry_after")
        if isinstance(retry_after, int) and not isinstance(retry_after, bool) \
                and retry_after > 0 and isinstance(args, list | tuple) and args \
                and args[0] == ErrorCode.MODEL_UNAVAILABLE:
            now = time.monotonic()
            placements = self.pool.placements(model, now)
            self.restarting.heard_refusal(model, placements, retry_after, now)
            if len(placements) > 1 and self.restarting.refusal(model, placements, now) is None:
                meta["retry_after"] = 1

    async def admit(self, model: str) -> None:
        """Make sure the model's queue exists; refuse a model no worker serves (see the
        module's docstring)."""
        if not self.queues.is_declared(model):
            await self.queues.declare(model)
        if self.restarting:  # (SHOAL_GATEWAY_UNSERVED=wait too: the workers would refuse)
            await self._refuse_while_restarting(model)
        if self.settings.gateway_unserved == "wait":
            return
        if self.pool.serves(model, time.monotonic()):
            return
        if await self.queues.consumer_count(model) == 0:
            raise ApiError(
                ErrorCode.MODEL_UNAVAILABLE,
                f"no worker serves {model} now (none consumes its queue "
                f"{self.queues.queues[model].name}); retry later. A gateway with "
                "SHOAL_GATEWAY_UNSERVED=wait queues such requests until a worker starts or "
                "their deadline passes (for deployments that scale workers to zero).",
                retry_after=self.settings.retry_after_s,
            )

    async def _refuse_while_restarting(self, model: str) -> None:
        """503 while every worker serving `model` is restarting its runtime (see the
        module's docstring); a consumer of its queue that sent no pool state (a plain
        Celery worker) may serve it: then it is published."""
        now = time.monotonic()
        placements = self.pool.placements(model, now)
        wait = self.restarting.refusal(model, placements, now)
        if wait is None:
            return
        try:
            if await self.queues.consumer_count(model) > len(placements):
                return
        except Exception:  # the broker will say so when the request is published
            return
        await asyncio.sleep(min(RESTART_HOLD_S, wait))
        now = time.monotonic()
        wait = self.restarting.refusal(model, self.pool.placements(model, now), now)
        if wait is None:  # it serves again (or should by now): published after all
            return
        retry_after = max(1, math.ceil(wait))
        raise ApiError(
            ErrorCode.MODEL_UNAVAILABLE,
            f"{model} is restarting on every worker that serves it (its model runtime "
            f"died and is being replaced); retry in about {retry_after}s",
            retry_after=retry_after)
