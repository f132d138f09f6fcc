"""shoal's worker: a Celery worker whose consumer feeds the model queues to a dispatcher.

A worker is a plain Celery worker of the app (`celery -A app worker`, `shoal worker`);
`install` adds its consumer bootsteps (`app.worker.steps`), which consume every served
model's queue into the dispatcher (`app.worker.lifecycle.dispatcher`): it holds each
request, has the scheduler (`batching.scheduler`) form batches, runs them on the model
runtime (`runtimes/`) and publishes the results (`app.worker.lifecycle.replies`). Models load on
demand (`app.worker.lifecycle.placement`); SIGTERM drains (`app.worker.shutdown`).

Importing this package loads none of that: `install` imports the steps when called
(`app.celery` calls it from a worker's `worker_init`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["install"]


def install(app: Any) -> None:
    """Add the worker's consumer bootsteps to `app` (before its worker builds its steps)."""
    from app.worker.steps import install as install_steps

    install_steps(app)
