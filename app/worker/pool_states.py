"""Workers tell each other and the gateways what they hold (`tasks.pool_state`).

Each worker publishes its pool state on the prefix's fanout exchange every
SHOAL_POOL_STATE_INTERVAL_S and on the loop's next turn after a change, and reads
its peers' states from an exclusive queue bound to it. A state from a worker it has
not heard from yet makes it publish its own at once, so a worker that starts learns
its peers within a round trip instead of an interval.

What a worker learns is which peers hold a model. While none does, handing work
to a peer costs that peer a load first, so the worker keeps up to a load's time of
work (`Lane.cold_peers_horizon_s`) before its returns and bounded prefetch let the
broker reach a cold peer (by consumer priority, only once the warm workers have no
free prefetch).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from kombu import Consumer, Exchange, Producer, Queue

from tasks.envelope import CONTENT_ENCODING, CONTENT_TYPE
from tasks.pool_state import (
    RESIDENT,
    STALE_AFTER_INTERVALS,
    decode_state,
    encode_state,
    pool_exchange,
)

log = logging.getLogger(__name__)


class PoolStates:
    def __init__(self, queue_prefix: str, interval_s: float) -> None:
        self.exchange = Exchange(pool_exchange(queue_prefix), type="fanout", durable=True)
        self.queue_prefix = queue_prefix
        self.interval_s = interval_s
        self.peers: dict[str, tuple[float, dict[str, Any]]] = {}  # worker -> (when, state)
        self.c: Any = None
        self.hostname = ""
        self.snapshot: Callable[[], dict[str, Any]] = dict
        # While the runtime refuses a model's batches (a failed restart's replacement
        # imports): the seconds until it should serve (`ProcessRuntime.ready_in`); gateways
        # answer that model's requests themselves meanwhile if no other worker serves it.
        self.ready_in: Callable[[str], float | None] = lambda model: None
        # Seconds the device has been busy so far (the worker's running total), and the
        # reading at the last publish: each state says the busy fraction since then.
        self.busy_seconds: Callable[[], float] | None = None
        self._busy_at: tuple[float, float] | None = None  # (monotonic, busy seconds)
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._due = False

    def open(self, c: Any, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Start listening and publish this worker's state (after every reconnect)."""
        self.c, self.hostname, self.snapshot = c, c.hostname, snapshot
        self.producer = Producer(c.connection.channel(), exchange=self.exchange)
        queue = Queue(f"{self.queue_prefix}.pool.{uuid.uuid4().hex}", self.exchange,
                      exclusive=True, auto_delete=True, durable=False)
        self.consumer = Consumer(c.connection.channel(), queues=[queue], no_ack=True,
                                 on_message=self._on_message, accept=["msgpack"])
        self.consumer.consume()
        self.publish()

    def soon(self) -> None:
        if not self._due and self.c is not None:
            self._due = True
            self.c.hub.call_soon(self.publish)

    def farewell(self) -> None:
        """A last state with no models: the worker is going away."""
        self.snapshot = lambda: {"budget_bytes": 0, "used_bytes": 0, "models": []}
        self.publish()
        self.producer = None

    def publish(self) -> None:
        self._due = False
        if self.producer is None:
            return
        state = {"worker": self.hostname, "at": time.time(), "interval_s": self.interval_s,
                 **self.snapshot()}
        for model in state["models"]:
            wait = self.ready_in(model["id"])
            if wait is not None:
                model["ready_in_s"] = round(wait, 3)
        busy = self._device_busy()
        if busy is not None:
            state["device_busy"] = busy
        try:
            self.producer.publish(encode_state(state), content_type=CONTENT_TYPE,
                                  content_encoding=CONTENT_ENCODING, delivery_mode=1)
        except Exception:  # a lost connection: the next one carries the state again
            log.warning("could not publish the pool state", exc_info=True)

    def _device_busy(self) -> float | None:
        """The fraction of the time since the last reading that the device was busy (None
        at the first reading, or without a running total)."""
        if self.busy_seconds is None:
            return None
        now, busy = time.monotonic(), self.busy_seconds()
        last, self._busy_at = self._busy_at, (now, busy)
        if last is None or now - last[0] <= 0:
            return None
        return round(max(0.0, busy - last[1]) / (now - last[0]), 4)

    def _on_message(self, message: Any) -> None:
        try:
            state = decode_state(message.body)
        except ValueError:
            log.warning("ignored a malformed pool-state message", exc_info=True)
            return
        worker = state["worker"]
        if worker == self.hostname:
            return
        new = worker not in self.peers
        self.peers[worker] = (time.monotonic(), state)
        if new:
            self.soon()  # let the newcomer know us now, not in an interval

    def fresh(self) -> list[dict[str, Any]]:
        """The peers' latest states, those gone stale forgotten."""
        now = time.monotonic()
        states = []
        for worker, (when, state) in list(self.peers.items()):
            interval = state.get("interval_s")
            interval = float(interval) if isinstance(interval, int | float) and interval > 0 \
                else self.interval_s
            if now - when > STALE_AFTER_INTERVALS * interval:
                del self.peers[worker]
                continue
            states.append(state)
        return states

    def warm_peers(self, model: str) -> int:
        """Other workers that hold `model`, by their latest fresh state."""
        return sum(any(isinstance(m, dict) and m.get("id") == model
                       and m.get("state") == RESIDENT for m in state["models"])
                   for state in self.fresh())
