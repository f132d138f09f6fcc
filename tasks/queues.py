"""kombu declarations of the model queues (the worker's and Celery clients' side).

The gateway declares the same queues with aio-pika from the same
`tasks.topology` arguments, so whichever process starts first wins and the
others' declarations are no-ops.
"""

from __future__ import annotations

from kombu import Exchange, Queue

from tasks.settings import Settings
from tasks.topology import DEAD_LETTER_ARGUMENTS, ModelQueue, QueueType, queue_for


def kombu_queues(mq: ModelQueue) -> tuple[Queue, Queue]:
    """(the model queue, its dead-letter queue) as kombu entities."""
    tasks = Exchange(mq.exchange, type="direct", durable=True)
    dlx = Exchange(mq.dead_letter_exchange, type="direct", durable=True)
    queue = Queue(
        mq.name, tasks, routing_key=mq.name, durable=True, queue_arguments=mq.arguments
    )
    dead = Queue(
        mq.dead_letter_queue, dlx, routing_key=mq.name, durable=True,
        queue_arguments=DEAD_LETTER_ARGUMENTS,
    )
    return queue, dead


def model_kombu_queue(model_id: str, settings: Settings,
                      queue_type: QueueType | None = None) -> Queue:
    """The model's queue; `queue_type` is its catalog entry's (`tasks.topology.queue_for`)."""
    return kombu_queues(queue_for(model_id, settings, queue_type))[0]
