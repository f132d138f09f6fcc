"""The health server's steps: /healthz, /readyz and /metrics (`app.worker.health`).

Two steps, one at each end of the worker's own: `HealthServer` comes first and serves from
when it is built, so the probes answer while the pinned models load (the model-queue step
builds the runtime next); `HealthReady` comes last, so the worker is reported consuming
only once every step of its own has started, and no longer from the first moment one
stops (steps stop in reverse).
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from app.worker.health import WorkerHealth, serve
from tasks.settings import get_settings


class HealthServer(bootsteps.StartStopStep):
    """Serves the probes and metrics from now on. Sets `c.shoal_health`."""

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        settings = get_settings()
        self.health = c.shoal_health = WorkerHealth(settings.worker_stall_s)
        serve(settings.worker_metrics_host, settings.worker_metrics_port, self.health.app)


class HealthReady(bootsteps.StartStopStep):
    """Reports the worker consuming (ready, its loop watched for stalls) once its steps
    have started, and stopped when they stop."""

    requires = ("app.worker.steps.drain:GracefulDrain",)

    def start(self, c: Any) -> None:
        if c.shoal_queues.started:
            c.shoal_health.consuming(c.hub)

    def stop(self, c: Any) -> None:
        c.shoal_health.stopped()
