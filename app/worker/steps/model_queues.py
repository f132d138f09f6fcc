"""The model-queue consumer step: every served model's queue fed to the dispatcher.

Each model the worker may serve (SHOAL_MODELS: ids or catalog globs) gets its queue
consumed on its own channel with its own prefetch (per-consumer QoS; quorum queues refuse
global QoS) and a consumer priority that says whether the model is loaded here
(`app.worker.lifecycle.consumers`); so does its dead-letter queue, whose messages are answered with
an error (`app.worker.deadletters`). The model runtime is its own process, started when
the step is built with the pinned models (SHOAL_PIN) loaded: before the consumer opens
its broker connection, whose heartbeats would otherwise go unanswered while the weights
load. Other models load on their first request (`app.worker.lifecycle.placement`). It survives
broker reconnects.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery import bootsteps
from kombu import Consumer

from app.worker.deadletters import DeadLetterAnswerer
from app.worker.lifecycle.decisions import LoopSettings
from app.worker.lifecycle.dispatcher import Dispatcher
from app.worker.lifecycle.loop import ConsumerLoop
from app.worker.lifecycle.view import WorkerView
from app.worker.limits import (
    batch_limits,
    cost_model,
    device_budget,
    device_profile,
    hold_horizon,
    hold_horizon_s,
    pinned_models,
)
from app.worker.metrics import (
    POISON_ISOLATED,
    RUNTIME_RESTARTS,
    SPARE_PROMOTIONS,
    START_FAILURES,
)
from app.worker.runtime import start_runtime
from app.worker.steps.health import HealthServer
from batching.hold import HoldLimits
from batching.lanes import Lane
from batching.pool import Pool
from tasks.catalog import load_catalog
from tasks.engines import is_double
from tasks.queues import kombu_queues
from tasks.settings import get_settings
from tasks.topology import queue_for

log = logging.getLogger(__name__)

DEAD_LETTER_PREFETCH = 16
GIL_SWITCH_INTERVAL_S = 0.0005


class PinnedOverBudget(RuntimeError):
    """The pinned models alone do not fit the device budget: the worker does not start."""


class ModelQueueConsumer(bootsteps.ConsumerStep):
    """Consumes every served model's queue (and dead-letter queue) into the dispatcher.

    Sets `c.shoal_queues` (this step) for the steps after it."""

    requires = (*bootsteps.ConsumerStep.requires, HealthServer)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        c.shoal_queues = self
        self.settings = settings = get_settings()
        # Results are confirmed asynchronously (app.worker.lifecycle.replies); events need no
        # confirms. Celery's blocking per-publish confirms stay on for clients.
        options = dict(c.app.conf.broker_transport_options or {})
        options.pop("confirm_publish", None)
        c.app.conf.broker_transport_options = options
        self.entries = load_catalog(settings.catalog_dir).select(settings.models)
        self.pinned = pinned_models(settings, [e.id for e in self.entries])
        self.lanes = {
            e.id: Lane(e.id, batch_limits(e, settings), cost_model(e, settings))
            for e in self.entries
        }
        self.hold = HoldLimits(
            horizon_batches=hold_horizon(self.entries, settings),
            max_horizon_s=hold_horizon_s(self.entries, settings),
            delivery_limit=settings.queue_delivery_limit,
            max_prefetch=max(settings.prefetch, 1),
        )
        # The event loop and the runtime thread hand every batch to each other; a thread
        # woken while the other holds the GIL waits up to the switch interval (5 ms by
        # default) for it. 0.5 ms took ~1 ms off a lone request, throughput unchanged
        # (BENCHMARKS.md, "A lone request").
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.runtime = start_runtime(
            self.entries, self.pinned, settings,
            chunk_tokens=max(lane.limits.max_tokens for lane in self.lanes.values()))
        RUNTIME_RESTARTS.set_function(lambda: self.runtime.restarts)
        POISON_ISOLATED.set_function(lambda: self.runtime.poison_isolated)
        # Only the PyTorch runtime has a spare; SGLang's and the simulated one count none.
        SPARE_PROMOTIONS.set_function(lambda: self.runtime.spare_promotions)
        START_FAILURES.set_function(lambda: self.runtime.start_failures)
        self.pool = Pool(device_budget(settings, self.runtime.device_bytes))
        pinned_bytes = sum(self.runtime.resident.get(m, 0) for m in self.pinned)
        if pinned_bytes > self.pool.budget:
            self.runtime.close()
            raise PinnedOverBudget(
                f"SHOAL_PIN: the pinned models take {pinned_bytes / 2**20:.1f} MiB, over this "
                f"worker's device budget of {self.pool.budget / 2**20:.1f} MiB "
                "(SHOAL_DEVICE_MEMORY_BYTES, else SHOAL_DEVICE_MEMORY_FRACTION of the "
                "device): pin fewer models, or raise the budget")
        self.view: WorkerView | None = None  # the loop, as the steps and remote control see it
        self.consumers: list[Any] = []
        self.started = False  # consuming (the steps after it start theirs then)
        self.c: Any = None

    def _profile_load_s(self) -> dict[str, float]:
        speed = self.settings.sim_speed if is_double(self.settings.runtime) else 1.0
        return {e.id: device_profile(e, self.settings).load_ms / 1000 / speed
                for e in self.entries}

    def warm_peers(self, model: str) -> Any:
        """How many other workers hold `model` loaded (their pool states say; 0 until the
        pool-state step has started)."""
        def count() -> int:
            states = getattr(self.c, "shoal_pool_states", None)
            return states.warm_peers(model) if states is not None else 0

        return count

    def start(self, c: Any) -> None:
        self.started = False
        if c.hub is None:
            raise RuntimeError("shoal's worker needs Celery's event loop (an AMQP broker)")
        if self.view is None:
            settings = self.settings
            self.view = WorkerView(Dispatcher(
                ConsumerLoop(c), self.runtime, self.lanes, self.hold,
                entries={e.id: e for e in self.entries}, pool=self.pool, pinned=self.pinned,
                load_s=self._profile_load_s(), settings=LoopSettings(
                    part_target_s=settings.part_target_ms / 1000,
                    prefetch=settings.prefetch,
                    lora_mixed_batches=settings.lora_mixed_batches,
                    feed_return_after_s=settings.feed_return_after_ms / 1000,
                    blob_url=settings.blob_url,
                    claim_upload_timeout_s=settings.claim_upload_timeout_s)))
        view = self.view
        assert view is not None
        self.c = c
        graceful = getattr(c, "shoal_graceful", None)
        if graceful is not None and graceful.requested_at is not None:
            # Reconnected while draining: what was held is redelivered to others anyway.
            graceful.finish()
            return
        view.open(c.connection)
        self.consumers = []
        for entry in self.entries:
            queue, dead = kombu_queues(queue_for(entry.id, self.settings, entry.queue_type))
            channel = c.connection.channel()
            consumer = Consumer(channel, queues=[queue], on_message=view.on_message,
                                accept=["msgpack", "json"])
            view.consume(entry.id, consumer, queue.name, _consumer_counter(channel, queue.name),
                         self.warm_peers(entry.id))
            dead_channel = c.connection.channel()
            answerer = DeadLetterAnswerer(view.replier, entry.id)
            dead_consumer = Consumer(dead_channel, queues=[dead], on_message=answerer.on_message,
                                     prefetch_count=DEAD_LETTER_PREFETCH)
            dead_consumer.consume()
            self.consumers += [consumer, dead_consumer]
            log.debug("consuming %s and %s", queue.name, dead.name)
        log.info("consuming the queues of %d models; pinned: %s", len(self.entries),
                 sorted(self.pinned) or "none")
        self.started = True

    def stop(self, c: Any) -> None:
        self.started = False
        if self.view is not None:
            self.view.drop_held()
        super().stop(c)

    def shutdown(self, c: Any) -> None:
        if self.view is not None:
            self.view.drop_held()
        super().shutdown(c)
        if self.view is not None:
            self.view.close()
            self.view = None
        else:
            self.runtime.close()


def _consumer_counter(channel: Any, queue: str) -> Any:
    def count() -> int:
        return int(channel.queue_declare(queue=queue, passive=True).consumer_count)

    return count
