"""The worker's consumer bootsteps, one per concern, in the order their `requires` give:

1. `HealthServer` (`app.worker.steps.health`): /healthz, /readyz, /metrics, served from
   when the worker is built (while the pinned models load too);
2. `ModelQueueConsumer` (`app.worker.steps.model_queues`): the runtime, the loop (seen by
   the steps and remote control through one `WorkerView`), and every served model's queue
   and dead-letter queue consumed into it;
3. `PoolStatePublisher` (`app.worker.steps.pool_state`): this worker's models, told to
   peers and gateways;
4. `GracefulDrain` (`app.worker.steps.drain`): SIGTERM drains before Celery's warm shutdown;
5. `HealthReady` (`app.worker.steps.health`): reported ready once all of that started.

They stop in reverse. Each finds the ones before it on the consumer (`c.shoal_*`), as
Celery's own steps do (`c.connection`, `c.event_dispatcher`). Importing this module also
registers the remote-control commands (`app.worker.control`).
"""

from __future__ import annotations

from typing import Any

from app.worker import control  # noqa: F401 (registers the remote-control commands)
from app.worker.steps.drain import GracefulDrain
from app.worker.steps.health import HealthReady, HealthServer
from app.worker.steps.model_queues import ModelQueueConsumer
from app.worker.steps.pool_state import PoolStatePublisher

STEPS = (HealthServer, ModelQueueConsumer, PoolStatePublisher, GracefulDrain, HealthReady)


def install(app: Any) -> None:
    """Add the worker's steps to `app`'s consumer blueprint."""
    for step in STEPS:
        app.steps["consumer"].add(step)
