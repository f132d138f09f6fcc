"""Queue names and arguments, shared by every process that declares them.

RabbitMQ refuses a re-declaration whose arguments differ, so the gateway
(aio-pika) and the worker (kombu) both take their arguments from here.

Naming rule, documented in the README: a model's queue is
`{prefix}.model.{slug}` where slug is the model id lower-cased, `/` replaced
by `.` and any other character outside `[a-z0-9._-]` replaced by `-`.
Its dead-letter queue is that name plus `.dead`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

_UNSAFE = re.compile(r"[^a-z0-9._-]")

# A model queue's type: SHOAL_QUEUE_TYPE for every model, or a catalog entry's
# `queue_type` for its own model (docs/models.md, "Queue type").
QueueType = Literal["quorum", "classic"]


def model_slug(model_id: str) -> str:
    return _UNSAFE.sub("-", model_id.lower().replace("/", "."))


@dataclass(frozen=True)
class ModelQueue:
    name: str
    exchange: str
    dead_letter_exchange: str
    dead_letter_queue: str
    arguments: dict[str, Any]


def task_exchange(prefix: str) -> str:
    return f"{prefix}.tasks"


def dead_letter_exchange(prefix: str) -> str:
    return f"{prefix}.dlx"


def model_queue(
    model_id: str, *, prefix: str, max_length: int, delivery_limit: int,
    queue_type: QueueType = "quorum",
) -> ModelQueue:
    """A model's queue. `classic` trades the delivery limit (poison messages that
    kill workers are never dead-lettered) and replication for less broker CPU."""
    name = f"{prefix}.model.{model_slug(model_id)}"
    dlx = dead_letter_exchange(prefix)
    arguments: dict[str, Any] = {
        "x-queue-type": queue_type,
        "x-dead-letter-exchange": dlx,
        "x-dead-letter-routing-key": name,
        "x-max-length": max_length,
        "x-overflow": "reject-publish",
    }
    if queue_type == "quorum":
        arguments["x-delivery-limit"] = delivery_limit
    return ModelQueue(
        name=name,
        exchange=task_exchange(prefix),
        dead_letter_exchange=dlx,
        dead_letter_queue=f"{name}.dead",
        arguments=arguments,
    )


DEAD_LETTER_ARGUMENTS: dict[str, Any] = {"x-queue-type": "quorum"}


def queue_for(model_id: str, settings: Any, queue_type: QueueType | None = None) -> ModelQueue:
    """The queue of `model_id` under the given `tasks.settings.Settings`.

    `queue_type` is the model's catalog entry's `queue_type`; None (an entry that sets
    none, or a model the catalog does not know) is the deployment's SHOAL_QUEUE_TYPE.
    The one place that rule lives: every process that declares a model's queue (gateway,
    worker, Celery client) calls this with the entry's value, so they all agree."""
    return model_queue(
        model_id,
        prefix=settings.queue_prefix,
        max_length=settings.queue_max_length,
        delivery_limit=settings.queue_delivery_limit,
        queue_type=queue_type or settings.queue_type,
    )
