"""Worker wiring: a consumer bootstep that feeds the model queues to the dispatcher.

Each served model's queue gets its own channel and consumer with its own
prefetch (per-consumer QoS; quorum queues refuse global QoS). Models are
loaded once, when the step is built: that is before the consumer opens its
broker connection, whose heartbeats would otherwise go unanswered while the
weights load. They stay loaded across broker reconnects.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.worker import control
from kombu import Consumer

from app.catalog import ModelEntry, load_catalog
from app.dispatcher import Dispatcher
from app.queues import kombu_queues
from app.settings import Settings, get_settings
from app.topology import queue_for
from batching.former import BatchLimits

log = logging.getLogger(__name__)


def batch_limits(entry: ModelEntry, settings: Settings) -> BatchLimits:
    """The catalog's tuned profile for this device, overridden by SHOAL_BATCH_* if set."""
    profile = entry.profile(settings.device)
    explicit = settings.model_fields_set
    max_tokens = profile.max_tokens if profile else settings.batch_max_tokens
    max_items = profile.max_items if profile else settings.batch_max_items
    max_delay_ms = profile.max_delay_ms if profile else settings.batch_max_delay_ms
    if "batch_max_tokens" in explicit:
        max_tokens = settings.batch_max_tokens
    if "batch_max_items" in explicit:
        max_items = settings.batch_max_items
    if "batch_max_delay_ms" in explicit:
        max_delay_ms = settings.batch_max_delay_ms
    return BatchLimits(max_tokens=max_tokens, max_items=max_items, max_delay_s=max_delay_ms / 1000)


class ModelQueueConsumer(bootsteps.ConsumerStep):
    """Consumes every served model's queue into the dispatcher."""

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.settings = get_settings()
        self.entries = load_catalog(self.settings.catalog_dir).require(self.settings.models)
        self.limits = {e.id: batch_limits(e, self.settings) for e in self.entries}
        self.runtime = self._runtime()
        self.dispatcher: Dispatcher | None = None

    def _runtime(self) -> Any:
        # Imported here: torch loads only in worker processes, never in clients.
        from runtimes.host import ModelHost

        host = ModelHost(
            device=self.settings.device,
            threads=self.settings.torch_threads,
            chunk_tokens=max(limit.max_tokens for limit in self.limits.values()),
        )
        host.load(self.entries)
        return host

    def start(self, c: Any) -> None:
        if c.hub is None:
            raise RuntimeError("shoal's worker needs Celery's event loop (an AMQP broker)")
        if self.dispatcher is None:
            self.dispatcher = Dispatcher(c, self.runtime, self.limits)
        self.consumers = []
        for entry in self.entries:
            queue, dead = kombu_queues(queue_for(entry.id, self.settings))
            channel = c.connection.channel()
            dead.bind(channel).declare()
            consumer = Consumer(
                channel,
                queues=[queue],
                on_message=self.dispatcher.on_message,
                prefetch_count=self.settings.prefetch,
                accept=["msgpack", "json"],
            )
            consumer.consume()
            self.consumers.append(consumer)
            log.info("consuming %s (prefetch %d)", queue.name, self.settings.prefetch)

    def stop(self, c: Any) -> None:
        if self.dispatcher is not None:
            self.dispatcher.drop_held()
        super().stop(c)

    def shutdown(self, c: Any) -> None:
        if self.dispatcher is not None:
            self.dispatcher.drop_held()
        super().shutdown(c)
        if self.dispatcher is not None:
            self.dispatcher.close()
            self.dispatcher = None


@control.inspect_command()
def active_queues(state: Any) -> list[dict]:
    """Celery's `active_queues` plus the model queues, so Flower's broker tab lists them."""
    consumer = state.consumer
    queues = list(consumer.task_consumer.queues) if consumer.task_consumer else []
    step = next((s for s in consumer.steps if isinstance(s, ModelQueueConsumer)), None)
    for kombu_consumer in (step.consumers if step else None) or []:
        queues.extend(kombu_consumer.queues)
    return [dict(q.as_dict(recurse=True)) for q in queues]


def install(app: Any) -> None:
    app.steps["consumer"].add(ModelQueueConsumer)
