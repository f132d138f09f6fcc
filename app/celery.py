"""The Celery app of a worker: `celery -A app worker` finds it here.

The app itself is tasks.celery_app's (clients share it); this module adds what only a
worker needs: its consumer class (`app.worker.reconnect.ReconnectingConsumer`, which
reconnects within a bounded back-off), and its consumer bootsteps (`app.worker.steps`)
when a worker of that app starts.
"""

from __future__ import annotations

from typing import Any

from celery.signals import worker_init

from app.worker.reconnect import ReconnectingConsumer
from tasks import tracing
from tasks.celery_app import app

__all__ = ["app"]

app.conf.worker_consumer = ReconnectingConsumer


@worker_init.connect
def _install_worker_steps(sender: Any = None, **_: Any) -> None:
    """Add shoal's consumer steps to a worker of this app before it builds its steps.

    Sent by every worker (`shoal worker`, `celery -A app worker`, a test's
    WorkController) and by nothing else: backend services import tasks.celery_app
    through tasks.client and must not load the dispatcher, batching, runtimes or worker
    metrics."""
    if getattr(sender, "app", None) is not app:
        return
    from app.worker import install

    tracing.setup("worker")  # if OTEL_* turns tracing on (`tasks.tracing`)
    install(app)
