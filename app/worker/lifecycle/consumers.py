"""The model queues' consumers: their prefetch, their priority, and their peers.

Each model queue's consumer has a RabbitMQ consumer priority (`x-priority`) that says
whether the model is loaded here, so the broker gives a model's traffic to the workers
that hold it and reaches a cold one only when they have no free prefetch; a cold consumer
takes one message at a time (the one that starts its load). The scheduler adapts a loaded
model's prefetch (`batching.scheduler`); both apply to new consumers only, so a change
consumes again. The number of the queue's consumers (this worker's peers) tells whether
a request could be handed to another worker.

With the fleet's placement, a worker stands by for a model the plan gives to others:
its consumer is cancelled, so the broker hands it none of that model's traffic, and
consumes again when the plan gives it the model or when nobody else consumes the queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.worker import metrics
from app.worker.lifecycle.placement import Placement
from batching.scheduler import Scheduler
from tasks.pool_state import COLD, LOADING, RESIDENT

log = logging.getLogger(__name__)

# How long a count of the queue's consumers stays fresh (returns need peers).
PEER_COUNT_TTL_S = 1.0

# Consumer priorities by the model's state here: the broker delivers to a lower one only
# while every higher one has no free prefetch.
PRIORITY = {RESIDENT: 10, LOADING: 5, COLD: 0}
# A model not loaded here takes one message at a time (the one that starts its load).
# Once its load is queued or running, its consumer takes the model's traffic as a loaded
# one would: else the broker hands the next request to a cold peer, which loads the same
# model too (measured: most loads of bench.pool's fleet were such duplicates).
COLD_PREFETCH = 1


@dataclass(slots=True)
class Consuming:
    """The kombu side of one served model: its consumer and how to count its peers."""

    consumer: Any  # kombu.Consumer of the model queue
    queue: str
    count_peers: Callable[[], int]  # consumers of the queue, us included
    warm_peers: Callable[[], int]  # other workers that hold the model loaded
    peers: int = 1
    checked: float = float("-inf")
    priority: int = 0  # its x-priority
    prefetch: int = COLD_PREFETCH


class Consumers:
    """The served models' queue consumers, by model (loop thread)."""

    def __init__(self, scheduler: Scheduler, placement: Placement, prefetch: int) -> None:
        self.scheduler = scheduler
        self.placement = placement
        self.prefetch = prefetch  # of a consumer whose model is loaded, before adapting
        self.by_model: dict[str, Consuming] = {}
        self.stopped = False  # cancelled for a drain: they stay cancelled
        self.standing_by: set[str] = set()  # cancelled: the fleet's plan gives them to others

    def consume(self, model: str, consumer: Any, queue: str, count_peers: Callable[[], int],
                warm_peers: Callable[[], int]) -> None:
        """Start consuming a model's queue with the prefetch and priority of its state."""
        state = self.placement.state(model)
        prefetch = COLD_PREFETCH if state == COLD else self.prefetch
        self.by_model[model] = Consuming(consumer, queue, count_peers, warm_peers,
                                         priority=PRIORITY[state])
        self._reconsume(model, prefetch, PRIORITY[state], first=True)

    def queue(self, model: str) -> str | None:
        """The model's queue, None while not consuming it (the connection was lost)."""
        consuming = self.by_model.get(model)
        return None if consuming is None else consuming.queue

    def follow_state(self, model: str, state: str) -> None:
        """The model became resident, loading or cold here: its consumer's prefetch and
        priority follow."""
        if model in self.by_model:
            prefetch = COLD_PREFETCH if state == COLD else self.prefetch
            self._reconsume(model, prefetch, PRIORITY[state])

    def set_prefetch(self, model: str, prefetch: int) -> None:
        consuming = self.by_model.get(model)
        if consuming is not None:
            self._reconsume(model, prefetch, consuming.priority)
        else:
            metrics.PREFETCH.labels(model).set(prefetch)

    def standby(self, model: str) -> None:
        """Stop consuming the model's queue (others serve it)."""
        consuming = self.by_model.get(model)
        if consuming is None or model in self.standing_by or self.stopped:
            return
        consuming.consumer.cancel()
        self.standing_by.add(model)
        metrics.STANDBY.labels(model).set(1)

    def resume(self, model: str) -> None:
        """Consume the model's queue again, with the prefetch and priority of its state."""
        if model not in self.standing_by or model not in self.by_model:
            return
        self.standing_by.discard(model)
        metrics.STANDBY.labels(model).set(0)
        consuming = self.by_model[model]
        self._reconsume(model, consuming.prefetch, consuming.priority, first=True)

    def consumers_of(self, model: str) -> int:
        """The queue's consumers now, this one included if it consumes (-1: unknown)."""
        consuming = self.by_model.get(model)
        if consuming is None:
            return -1
        try:
            consuming.peers = consuming.count_peers()
        except Exception:
            log.warning("could not count the consumers of %s", model, exc_info=True)
            return -1
        return consuming.peers

    def _reconsume(self, model: str, prefetch: int, priority: int, first: bool = False) -> None:
        """Consume again with a new per-consumer prefetch and priority (both apply to new
        consumers only)."""
        if self.stopped:
            return  # consumers stay cancelled
        consuming = self.by_model[model]
        consuming.priority, consuming.prefetch = priority, prefetch
        if model in self.standing_by:
            return  # applies when it consumes again
        consumer = consuming.consumer
        if not first:
            consumer.cancel()
        for queue in consumer.queues:
            queue.consumer_arguments = {"x-priority": priority}
        consumer.qos(prefetch_count=prefetch)
        consumer.consume()
        self.scheduler.prefetch_applied(model, prefetch)
        metrics.PREFETCH.labels(model).set(prefetch)

    def peers(self, model: str, now: float) -> int:
        """The queue's consumers, this one included (counted at most every
        PEER_COUNT_TTL_S)."""
        consuming = self.by_model.get(model)
        if consuming is None:
            return 1
        if now - consuming.checked > PEER_COUNT_TTL_S:
            try:
                consuming.peers = consuming.count_peers()
            except Exception:
                log.warning("could not count the consumers of %s", model, exc_info=True)
            consuming.checked = now
            # Peers that would first have to load the model are worth handing work to only
            # once it would wait here longer than that load.
            cold_only = consuming.peers > 1 and consuming.warm_peers() == 0
            self.scheduler.lanes[model].cold_peers_horizon_s = (
                self.placement.load_seconds(model) if cold_only else None)
        return consuming.peers

    def stop(self) -> None:
        """Cancel every consumer (a drain): nothing more is delivered."""
        self.stopped = True
        for consuming in self.by_model.values():
            try:
                consuming.consumer.cancel()
            except Exception:  # a lost connection redelivers everything anyway
                log.warning("could not cancel the consumer of %s", consuming.queue,
                            exc_info=True)

    def clear(self) -> None:
        """Forget the consumers (their connection was lost)."""
        self.by_model.clear()
        for model in self.standing_by:
            metrics.STANDBY.labels(model).set(0)
        self.standing_by.clear()  # a new connection consumes every queue again
