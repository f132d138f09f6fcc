"""The contract every layer may import: what gateways, Celery clients, workers and
runtimes agree on.

The task envelope and schema, errors, the model catalog (`tasks.catalog`), the queue
topology (`tasks.topology`, `tasks.queues`), settings (`tasks.settings`) and the
Celery app (`tasks.celery_app`). Import-light on purpose: nothing here imports torch,
and only `tasks.celery_app` (through `tasks.client` or `tasks.queues`) imports Celery
or kombu. It imports nothing of shoal's above it.
"""
