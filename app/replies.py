"""Answer task messages: publish each result to its `reply_to`, then ack the message.

Results are Celery rpc result messages, so a Celery client's
`AsyncResult.get()` reads them. They are published on a channel of the
worker's own connection in publisher-confirm mode without waiting: the task
message is acked when the broker confirms its result (`basic.ack` arrives on
the event loop like any frame). That keeps delivery at-least-once without a
round trip per request: if the worker dies in between, the message is
redelivered and the gateway drops the duplicate reply.

A shoal gateway marks its messages with `shoal_reply_batch`; their results
are collected while a batch is answered and go out as one message per reply
queue (`{"results": [...]}` with header `shoal_multi`), one broker message
for many requests. Flower learns of every answer from the task events sent
here.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import amqp
import msgpack

from tasks.envelope import CONTENT_ENCODING, CONTENT_TYPE, H_MULTI, H_REPLY_BATCH
from tasks.errors import ErrorCode, ShoalError

log = logging.getLogger(__name__)

SUCCESS, FAILURE = "SUCCESS", "FAILURE"


def rpc_result(task_id: str, status: str, result: Any) -> dict[str, Any]:
    """The body Celery's rpc backend publishes (and its clients decode)."""
    return {
        "task_id": task_id,
        "status": status,
        "result": result,
        "traceback": None,
        "children": [],
        "date_done": datetime.now(UTC).isoformat(),
    }


class Replier:
    def __init__(self, consumer: Any) -> None:
        self.c = consumer
        self.channel: Any = None
        self._published = 0  # publisher sequence number of the last publish
        self._unconfirmed: dict[int, list[Any]] = {}  # sequence -> task messages to ack
        self._bundles: dict[str, list[tuple[dict[str, Any], Any]]] = {}
        self._batching = False

    def open(self, connection: Any) -> None:
        """(Re)open the confirm-mode channel on the consumer's connection."""
        channel = connection.channel()
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        self.channel = channel
        self._published = 0
        self._unconfirmed.clear()
        self._bundles.clear()

    # --- answering ------------------------------------------------------------------------

    def begin_batch(self) -> None:
        """Collect gateway replies until `end_batch`, one message per reply queue."""
        self._batching = True

    def end_batch(self) -> None:
        self._batching = False
        bundles, self._bundles = self._bundles, {}
        for reply_to, entries in bundles.items():
            body = msgpack.packb({"results": [payload for payload, _ in entries]},
                                 use_bin_type=True)
            self._send(reply_to, "", body, [message for _, message in entries],
                       headers={H_MULTI: 1})

    def success(self, message: Any, task_id: str, result: dict[str, Any],
                runtime_s: float) -> None:
        self._answer(message, task_id, rpc_result(task_id, SUCCESS, result))
        self.event("task-succeeded", task_id, result=f"<{result.get('count')} vectors>",
                   runtime=runtime_s)

    def failure(self, message: Any, task_id: str, code: str | None, text: str | None) -> None:
        code = code or ErrorCode.INTERNAL
        self._answer(message, task_id,
                     rpc_result(task_id, FAILURE, ShoalError(code, text or "").as_celery_failure()))
        self.event("task-failed", task_id, exception=f"ShoalError({code!r}, {text!r})",
                   traceback="")

    def event(self, kind: str, task_id: str, **fields: Any) -> None:
        dispatcher = getattr(self.c, "event_dispatcher", None)
        if dispatcher is not None and dispatcher.enabled:
            dispatcher.send(kind, uuid=task_id, **fields)

    def _answer(self, message: Any, task_id: str, payload: dict[str, Any]) -> None:
        props = message.properties
        reply_to = props.get("reply_to")
        if not reply_to:  # fire-and-forget: nobody waits for a result
            message.ack()
            return
        headers = message.headers or {}
        if self._batching and headers.get(H_REPLY_BATCH):
            self._bundles.setdefault(reply_to, []).append((payload, message))
            return
        body = msgpack.packb(payload, use_bin_type=True)
        self._send(reply_to, props.get("correlation_id") or task_id, body, [message])

    def _send(self, reply_to: str, correlation_id: str, body: bytes, messages: list[Any],
              headers: dict[str, Any] | None = None) -> None:
        try:
            self.channel.basic_publish(
                amqp.Message(body, content_type=CONTENT_TYPE, content_encoding=CONTENT_ENCODING,
                             correlation_id=correlation_id, application_headers=headers or {}),
                exchange="", routing_key=reply_to,
            )
        except Exception:
            # Left unacked, the messages come back once the connection is re-established.
            log.exception("could not publish %d results; they will be redelivered",
                          len(messages))
            return
        self._published += 1
        self._unconfirmed[self._published] = messages

    # --- confirms -------------------------------------------------------------------------

    def _confirmed(self, tag: int, multiple: bool) -> list[list[Any]]:
        tags = [t for t in self._unconfirmed if t <= tag] if multiple else [tag]
        return [self._unconfirmed.pop(t) for t in tags if t in self._unconfirmed]

    def _on_ack(self, tag: int, multiple: bool) -> None:
        for messages in self._confirmed(tag, multiple):
            for message in messages:
                message.ack()

    def _on_nack(self, tag: int, multiple: bool) -> None:
        # The broker lost the results: run those requests again.
        for messages in self._confirmed(tag, multiple):
            log.warning("broker refused %d results; requeueing their requests", len(messages))
            for message in messages:
                message.reject(requeue=True)
