"""Answer dead-lettered requests, so a caller gets an error instead of a timeout.

RabbitMQ dead-letters a model queue's message when it expired (its deadline
passed while queued), when it was delivered `x-delivery-limit` times without
being acked (it keeps killing workers, or keeps being returned), or when a
worker rejected it as unreadable. Workers consume the dead-letter queues too,
tell the waiting caller why, log it, and ack it.
"""

from __future__ import annotations

import logging
from typing import Any

from app.worker.lifecycle.replies import Delivery, Replier
from app.worker.metrics import DEAD_LETTERED
from tasks.envelope import H_COALESCED, read_coalesced
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)

_ANSWERS = {
    "expired": (ErrorCode.DEADLINE_EXCEEDED,
                "the request's deadline passed while it waited in the queue"),
    "delivery_limit": (ErrorCode.POISON_INPUT,
                       "the request was delivered {count} times without completing; it may "
                       "crash workers"),
    "rejected": (ErrorCode.INVALID_REQUEST, "a worker could not read the request"),
    "maxlen": (ErrorCode.QUEUE_FULL, "the queue was full"),
}


def death_reason(headers: dict[str, Any]) -> tuple[str, int]:
    """(why the message was dead-lettered, how many times it was delivered)."""
    deaths = headers.get("x-death") or []
    first = deaths[0] if deaths and isinstance(deaths[0], dict) else {}
    reason = headers.get("x-first-death-reason") or first.get("reason") or "unknown"
    count = int(headers.get("x-delivery-count") or first.get("count") or 1)
    return str(reason), count


class DeadLetterAnswerer:
    def __init__(self, replier: Replier, model: str) -> None:
        self.replier = replier
        self.model = model

    def on_message(self, message: Any) -> None:
        headers = message.headers or {}
        reason, count = death_reason(headers)
        DEAD_LETTERED.labels(self.model, reason).inc()
        if H_COALESCED in headers:  # several requests: each caller gets the answer
            try:
                task_ids = [member.task_id for member in read_coalesced(headers, message.body)]
            except ValueError:
                task_ids = []
        else:
            task_id = headers.get("id") or message.properties.get("correlation_id")
            task_ids = [task_id] if task_id else []
        log.warning("dead-lettered requests %s of %s: %s (delivered %d times)",
                    task_ids, self.model, reason, count)
        if not task_ids:
            message.ack()  # nobody to answer
            return
        code, text = _ANSWERS.get(reason, (ErrorCode.INTERNAL, "the request was dead-lettered"))
        delivery = Delivery(message, len(task_ids))
        # Expired in the queue, never delivered: it did not run, so a client may retry it.
        started = False if reason == "expired" and "x-delivery-count" not in headers else None
        for task_id in task_ids:
            self.replier.failure(delivery, task_id, code, text.format(count=count),
                                 started=started)
