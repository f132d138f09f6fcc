"""The graceful-drain step: SIGTERM (or SIGINT) drains the worker before Celery's warm
shutdown (`app.worker.shutdown` takes the signals; `WorkerView.begin_drain` and
`app.worker.lifecycle.drain.Drain` are the loop's side): it stops consuming, hands back
what has not started, and finishes, publishes and acks what runs, within
SHOAL_SHUTDOWN_GRACE_S."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import bootsteps

from app.worker.metrics import DRAINING, SHUTDOWNS_FORCED
from app.worker.shutdown import GracefulShutdown
from app.worker.steps.pool_state import PoolStatePublisher

log = logging.getLogger(__name__)


class GracefulDrain(bootsteps.StartStopStep):
    """Takes the shutdown signals while the model queues are consumed. Sets
    `c.shoal_graceful`."""

    requires = (PoolStatePublisher,)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.grace_s = c.shoal_queues.settings.shutdown_grace_s
        self.graceful = c.shoal_graceful = GracefulShutdown(self.grace_s, self._begin_drain,
                                                            self._force_exit)
        self.c: Any = None
        self.drain_started = 0.0  # monotonic

    def start(self, c: Any) -> None:
        self.c = c
        if c.shoal_queues.started:
            self.graceful.attach(c.hub)

    def stop(self, c: Any) -> None:
        self.graceful.detach()
        if self.graceful.draining:
            # The connection was lost while draining: every held message is redelivered.
            self.graceful.finish()

    # --- on the loop ------------------------------------------------------------------

    def _begin_drain(self) -> None:
        c = self.c
        c.shoal_health.draining()
        queues = c.shoal_queues
        view = queues.view
        if view is None:
            self.graceful.finish()
            return
        self.drain_started = time.monotonic()
        DRAINING.set(1)
        publisher = next(s for s in c.steps if isinstance(s, PoolStatePublisher))
        publisher.stop_publishing()
        # Gateways stop counting this worker as serving its models now.
        publisher.farewell()
        handed = view.begin_drain(self._drained)
        # Nothing more from the dead-letter queues, nor Celery's own task queue (its remote
        # control and events go on until Celery's shutdown).
        for consumer in [*queues.consumers, c.task_consumer]:
            if consumer is not None:
                try:
                    consumer.cancel()
                except Exception:
                    log.warning("could not cancel a consumer while draining", exc_info=True)
        log.warning("draining for shutdown: stopped consuming; handed back %d requests that "
                    "had not started (%s); finishing %d running (batches of %s), %d results "
                    "to confirm; grace %gs", sum(handed.values()),
                    ", ".join(f"{m}: {n}" for m, n in handed.items()) or "none",
                    view.unfinished, ", ".join(str(n) for n in view.batch_sizes()) or "none",
                    view.unconfirmed, self.grace_s)
        view.check_drain()

    def _drained(self) -> None:
        view = self.c.shoal_queues.view
        assert view is not None
        DRAINING.set(0)
        log.warning("drained in %.2fs: %d requests answered after the signal (results "
                    "confirmed, messages acked), %d handed back; exiting",
                    time.monotonic() - self.drain_started, view.answered, view.handed_back)
        # Flower's last task events of the drain: Celery flushes its buffer on the loop's
        # next turn, which the shutdown does not take.
        events = getattr(self.c, "event_dispatcher", None)
        if events is not None:
            try:
                events.flush()
            except Exception:
                log.warning("could not flush the last task events", exc_info=True)
        self.graceful.finish()

    def _force_exit(self, why: str) -> None:
        SHUTDOWNS_FORCED.inc()
        DRAINING.set(0)
        view = self.c.shoal_queues.view if self.c is not None else None
        unfinished = view.abandon() if view is not None else 0
        log.error("shutdown forced (%s) %.2fs after the signal: %d requests left unfinished "
                  "and unacked (the broker redelivers them), %d answered, %d handed back",
                  why, self.graceful.elapsed(), unfinished,
                  view.answered if view else 0, view.handed_back if view else 0)
        if self.c is not None:
            self.c.controller.exitcode = 1  # as a crash would say
