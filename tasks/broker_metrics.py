"""Prometheus metrics of a process's link to the broker: up or down, reconnects, outage time.

The worker's series are `shoal_broker_*`, the gateway's `shoal_gateway_broker_*`; each
process creates only its own (`worker_link()`, `gateway_link()`), in prometheus_client's
default registry, so the worker's and the gateway's /metrics export them with the rest.
An outage shows as `..._connected 0` while it lasts; once the link is back, its length is
added to `..._disconnected_seconds_total` and `..._reconnects_total` counts one more.
Gauges carry a `multiprocess_mode` for `shoal gateway --workers N`
(gateway/edge/gateway_metrics.py): there, `connected` is the lowest over the live processes.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import cache

from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)


class BrokerLink:
    """The state of one process's broker connection, mirrored in metrics.

    Called from the process's connection code: `connected(endpoint)` each time a
    connection is (re-)established, `lost(why)` when it drops. Thread-safe (a Celery
    worker reconnects on its consumer thread; its metrics are read on another)."""

    def __init__(self, prefix: str, who: str) -> None:
        self.who = who
        self._connected = Gauge(f"{prefix}_broker_connected",
                                f"1 while the {who}'s broker connection is up, else 0",
                                multiprocess_mode="livemin")
        self._reconnects = Counter(f"{prefix}_broker_reconnects",
                                   f"times the {who} connected again after losing its broker "
                                   "connection")
        self._down_seconds = Counter(f"{prefix}_broker_disconnected_seconds",
                                     f"seconds the {who} spent without a broker connection "
                                     "(added when it is back)")
        self._lock = threading.Lock()
        self._ever_connected = False
        self._down_since: float | None = time.monotonic()
        self.endpoint: str | None = None
        self._connected.set(0)

    @property
    def up(self) -> bool:
        return self._down_since is None

    def connected(self, endpoint: str) -> None:
        with self._lock:
            down_since, self._down_since = self._down_since, None
            reconnect = self._ever_connected and down_since is not None
            self._ever_connected = True
            self.endpoint = endpoint
        self._connected.set(1)
        if reconnect and down_since is not None:
            outage = time.monotonic() - down_since
            self._reconnects.inc()
            self._down_seconds.inc(outage)
            log.warning("%s reconnected to the broker at %s after %.1fs", self.who, endpoint,
                        outage)

    def lost(self, why: object) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
        self._connected.set(0)
        log.warning("%s lost its broker connection (%s): reconnecting", self.who, why)


@cache
def worker_link() -> BrokerLink:
    return BrokerLink("shoal", "worker")


@cache
def gateway_link() -> BrokerLink:
    return BrokerLink("shoal_gateway", "gateway")
