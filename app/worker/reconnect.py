"""The worker's consumer: Celery's, reconnecting within a bounded back-off, its link in metrics.

Celery's consumer reconnects with kombu's `ensure_connection` defaults: it sleeps 2, 4,
6, ... up to 30 s between rounds of attempts, so a worker whose broker was away for a
minute comes back up to 30 s after it. Here a round (every URL of SHOAL_BROKER_URL
once, kombu's failover cycle; no sleep between the URLs of a round) is followed by at
most SHOAL_BROKER_RECONNECT_MAX_S of sleep. The connection's state goes to
`tasks.broker_metrics.worker_link()`.

`app.celery` sets this class as `worker_consumer`; only a worker uses it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from amqp.exceptions import ResourceLocked
from celery.worker.consumer import Consumer

from tasks.broker_metrics import worker_link
from tasks.broker_urls import endpoint, split_urls
from tasks.settings import get_settings

# The first sleep of a back-off, if the bound allows it: a node that restarts takes
# seconds, so hammering it every few ms gains nothing.
FIRST_INTERVAL_S = 0.25
# At most one "Cannot connect" error this often during an outage.
QUIET_LOG_S = 10.0

log = logging.getLogger(__name__)


def _quieted(errback: Any) -> Any:
    """`errback` (Celery's logging of a failed connection attempt) called at most once
    every QUIET_LOG_S; the attempts in between are logged at debug level."""
    if errback is None:
        return None
    last = float("-inf")

    def quiet(exc: Exception, interval: float) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= QUIET_LOG_S:
            last = now
            errback(exc, interval)
        else:
            log.debug("broker connection attempt failed: %r", exc)

    return quiet


def reconnect_intervals(bound_s: float) -> dict[str, float]:
    """kombu's `ensure_connection` interval arguments for a back-off that grows from
    FIRST_INTERVAL_S (or the bound, if smaller) to at most `bound_s`."""
    start = min(FIRST_INTERVAL_S, bound_s)
    return {"interval_start": start, "interval_step": start, "interval_max": bound_s}


class ReconnectingConsumer(Consumer):
    class Blueprint(Consumer.Blueprint):
        # Without Celery's native delayed delivery (ETA tasks on quorum queues; shoal sends
        # none): it turns on as soon as Celery's default queue is a quorum queue (on a
        # cluster), then sets up every broker URL in turn, sleeping 1-5 s on the event loop
        # between tries of a node that is down: heartbeats go unanswered, the broker drops
        # the connection, and the worker reconnects into the same wait again.
        default_steps = [step for step in Consumer.Blueprint.default_steps
                         if not step.endswith(":DelayedDelivery")]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # After a failover the exclusive pidbox queue (remote control) of the connection
        # that died with its node can stay locked for a moment: redeclaring it answers 405
        # RESOURCE_LOCKED, a channel error Celery takes as unrecoverable, and the worker
        # exited (bench.faults broker-node-stop: 2 of 5 runs, 212 requests lost in one).
        # Reconnect instead, as for a lost connection.
        self.connection_errors = (*self.connection_errors, ResourceLocked)
        self.link = worker_link()
        self._intervals = reconnect_intervals(get_settings().broker_reconnect_max_s)

    def ensure_connected(self, conn: Any) -> Any:
        # Celery passes no intervals to ensure_connection, so its defaults would apply; and
        # it logs an ERROR per failed attempt, every URL every round: quieted to one per
        # QUIET_LOG_S (the outage shows in the metrics all along).
        ensure = conn.ensure_connection

        def bounded(errback: Any = None, *args: Any, **kwargs: Any) -> Any:
            return ensure(_quieted(errback), *args, **{**kwargs, **self._intervals})

        conn.ensure_connection = bounded
        return super().ensure_connected(conn)

    def connection_for_read(self, heartbeat: Any = None) -> Any:
        # The consuming connection (events and control replies use others).
        conn = super().connection_for_read(heartbeat)
        self.link.connected(endpoint(conn.as_uri()))
        self._prefer(endpoint(conn.as_uri()))
        return conn

    def _prefer(self, live: str) -> None:
        """Put the node just reached first in the app's URL list: the worker's other
        connections (events, remote control, its publishers), opened next, go straight to
        it instead of trying a node that is down first (a whole connect timeout for a
        host that does not answer; on this machine a failed first try of the events
        connection also left a dead reader in the event loop, and a second restart)."""
        urls = split_urls(str(self.app.conf.broker_url))
        first = next((i for i, url in enumerate(urls) if endpoint(url) == live), 0)
        if first:
            self.app.conf.broker_url = ";".join(urls[first:] + urls[:first])

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        self.link.lost(repr(exc))
        super().on_connection_error_after_connected(exc)
