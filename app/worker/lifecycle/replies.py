"""Answer task messages: publish each result to its `reply_to`, then ack the message.

Results are Celery rpc result messages, so a Celery client's
`AsyncResult.get()` reads them. They are published on a channel of the
worker's own connection in publisher-confirm mode without waiting: a request
is settled when the broker confirms its result (`basic.ack` arrives on the
event loop like any frame), and its message is acked once every request it
carries is settled (`Delivery`: one request for a Celery client's message,
several for a shoal gateway's coalesced one). That keeps delivery
at-least-once without a round trip per request: if the worker dies in
between, the message is redelivered and the gateway drops the duplicate
replies.

A shoal gateway marks its messages with `shoal_reply_batch`; their results
are collected while a batch is answered and go out as one message per reply
queue (`{"results": [...]}` with header `shoal_multi`), one broker message
for many requests. A gateway that reads result contract 2 (`shoal_result_contract`)
gets what that message's results share (model, batch, worker: `tasks.served.SHARED`)
once, under `shared`, instead of in each result; everyone else gets whole results.

Flower learns of every request from the task events sent here, which go out
only while the worker's event dispatcher takes the `task` group, Celery's own
convention: from the start with `celery worker -E` (SHOAL_TASK_EVENTS), or
once Flower (or `celery control enable_events`) enables them, until
`disable_events`. When they are off, a request costs a flag check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import amqp
import msgpack
from celery.utils.time import utcoffset

from app.worker.lifecycle.loop import Identity
from tasks.envelope import (
    CONTENT_ENCODING,
    CONTENT_TYPE,
    FAILURE,
    H_MULTI,
    H_REPLY_BATCH,
    H_RESULT_CONTRACT,
    PROGRESS,
    SUCCESS,
)
from tasks.errors import ErrorCode, ShoalError
from tasks.served import WORKER, take_shared

log = logging.getLogger(__name__)

EVENT_BUFFER_LIMIT = 1024  # task events per event message (Celery's default: 24)


class Delivery:
    """A delivered message and how many of its requests are still open.

    Acked when the last one is settled (answered and confirmed, or handed on);
    requeued as a whole at most once, after which nothing more of it is acked (a
    second ack or reject of a tag closes the channel)."""

    __slots__ = ("closed", "contract", "message", "on_acked", "open", "received",
                 "reply_batch", "reply_to", "requests", "shares")

    def __init__(self, message: Any, requests: int = 1) -> None:
        self.message = message
        self.received = time.time()  # epoch seconds: a request's trace starts here
        self.requests = requests
        self.open = requests
        self.closed = False
        self.reply_to: str | None = message.properties.get("reply_to")
        headers = message.headers or {}
        self.reply_batch = bool(headers.get(H_REPLY_BATCH))
        # The result contract its sender reads (1: whole results, as Celery's clients).
        contract = headers.get(H_RESULT_CONTRACT)
        self.contract = contract if type(contract) is int else 1
        # Its answers, given while a batch is answered, go out in a reply message that says
        # once what they share (`Replier.shares`).
        self.shares = self.reply_batch and self.contract >= 2 and self.reply_to is not None
        # Called once the message is acked, never if it is requeued (a claim-checked
        # request's blobs are deleted then: its next delivery needs them).
        self.on_acked: list[Callable[[], None]] | None = None

    @property
    def untouched(self) -> bool:
        """Nothing of it is settled yet: giving it back whole wastes no work."""
        return not self.closed and self.open == self.requests

    def settle(self) -> None:
        self.open -= 1
        if self.open == 0 and not self.closed:
            self.closed = True
            self.message.ack()
            for callback in self.on_acked or ():
                try:
                    callback()
                except Exception:  # cleanup must not keep other requests from settling
                    log.exception("an on_acked callback failed")

    def requeue(self) -> None:
        if not self.closed:
            self.closed = True
            self.message.reject(requeue=True)


def date_done() -> str:
    """Now, as Celery's results say when they were done."""
    return datetime.now(UTC).isoformat()


def rpc_result(task_id: str, status: str, result: Any, done: str | None = None
               ) -> dict[str, Any]:
    """The body Celery's rpc backend publishes (and its clients decode); `done`: its
    `date_done` (`date_done()`), if the caller has it already."""
    return {
        "task_id": task_id,
        "status": status,
        "result": result,
        "traceback": None,
        "children": [],
        "date_done": done or datetime.now(UTC).isoformat(),
    }


class Replier:
    def __init__(self, loop: Identity) -> None:
        self.loop = loop  # the worker's name, Celery's task events
        self.channel: Any = None
        self._published = 0  # publisher sequence number of the last publish
        # publish sequence number -> the requests its confirm settles
        self._unconfirmed: dict[int, list[Delivery]] = {}
        self._bundles: dict[str, list[tuple[dict[str, Any], Delivery]]] = {}
        self._batching = False
        # Read once per batch at `begin_batch` (both hold for all its answers: the loop
        # that could change the events' flag is busy answering them), not per request.
        self._events = False
        self._done: str | None = None
        self._utcoffset_value = 0
        self._utcoffset_until = float("-inf")
        # Told after the broker confirmed (or refused) publishes: a draining worker waits
        # for the last confirm before it exits.
        self.on_confirmed: Callable[[], None] = lambda: None

    @property
    def unconfirmed(self) -> int:
        """Publishes the broker has not confirmed yet (their messages are not acked)."""
        return len(self._unconfirmed)

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
        self._events = self.task_events
        self._done = date_done()

    def end_batch(self) -> None:
        done = self._done or date_done()
        self._batching = False
        self._done = None
        bundles, self._bundles = self._bundles, {}
        for reply_to, entries in bundles.items():
            reply: dict[str, Any] = {"results": [payload for payload, _ in entries]}
            # Senders of both contracts may share a reply queue (the jobs' replies, while
            # gateways of two versions run): only contract 2's payloads were built short.
            short = [payload for payload, delivery in entries if delivery.contract >= 2]
            if short:
                self._shorten(reply, short, done)
            body = msgpack.packb(reply, use_bin_type=True)
            self._send(reply_to, "", body, [delivery for _, delivery in entries],
                       headers={H_MULTI: 1})

    def shares(self, delivery: Delivery) -> bool:
        """Whether `delivery`'s answer goes out in a reply message that says what its
        results share once (result contract 2): its result is stamped without them."""
        return self._batching and delivery.shares

    def _shorten(self, reply: dict[str, Any], payloads: list[dict[str, Any]],
                 done: str) -> None:
        """A reply message of `payloads` (built short: `_payload`) for a sender that reads
        result contract 2: the rpc envelope and what its results share, once
        (`tasks.envelope.decode_results` puts them back into each)."""
        results = [p["result"] for p in payloads if p["status"] == SUCCESS]
        if len(payloads) == 1:  # shares nothing: whole is smallest (a lone request's)
            payloads[0].update(traceback=None, children=[], date_done=done)
            for result in results:
                result[WORKER] = self.loop.hostname
            return
        reply["envelope"] = {"traceback": None, "children": [], "date_done": done}
        if results:
            shared = take_shared(results) or {}
            shared[WORKER] = self.loop.hostname  # not stamped into them (`shares`)
            reply["shared"] = shared

    def _payload(self, delivery: Delivery, task_id: str, status: str, result: Any
                 ) -> dict[str, Any]:
        if self._batching and delivery.shares:
            return {"task_id": task_id, "status": status, "result": result}  # `_shorten`
        return rpc_result(task_id, status, result, self._done)

    def success(self, delivery: Delivery, task_id: str, result: dict[str, Any],
                runtime_s: float) -> None:
        # `_payload`, inline: this runs once per answered request.
        self._answer(delivery, task_id,
                     {"task_id": task_id, "status": SUCCESS, "result": result}
                     if self._batching and delivery.shares
                     else rpc_result(task_id, SUCCESS, result, self._done))
        if self._events if self._batching else self.task_events:
            self._event("task-succeeded", task_id, result=f"<{result.get('count')} vectors>",
                        runtime=runtime_s)

    def failure(self, delivery: Delivery, task_id: str, code: str | None,
                text: str | None, retry_after: int | None = None,
                started: bool | None = None) -> None:
        """`started`: False for a request refused before it ran (the gateway may then
        let clients retry a DEADLINE_EXCEEDED), None when not known."""
        code = code or ErrorCode.INTERNAL
        error = ShoalError(code, text or "", retry_after, started=started)
        self._answer(delivery, task_id,
                     self._payload(delivery, task_id, FAILURE, error.as_celery_failure()))
        if self._events if self._batching else self.task_events:
            self._event("task-failed", task_id, exception=f"ShoalError({code!r}, {text!r})",
                        traceback="")

    def progress(self, updates: list[tuple[Delivery, str, dict[str, Any]]]) -> None:
        """Publish PROGRESS states (a streamed request's new output) before its result: on
        the channel its result will take, so they arrive first and in order. Updates for
        one gateway's reply queue go out as one message; nothing is settled by them."""
        bundles: dict[str, list[dict[str, Any]]] = {}
        for delivery, task_id, meta in updates:
            reply_to = delivery.reply_to
            if not reply_to:
                continue
            payload = rpc_result(task_id, PROGRESS, meta)
            if delivery.reply_batch:
                bundles.setdefault(reply_to, []).append(payload)
            else:
                self._send(reply_to, task_id, msgpack.packb(payload, use_bin_type=True), [])
        for reply_to, payloads in bundles.items():
            body = msgpack.packb({"results": payloads}, use_bin_type=True)
            self._send(reply_to, "", body, [], headers={H_MULTI: 1})

    @property
    def task_events(self) -> bool:
        """Whether task events go out now, as Celery's own worker decides: its event
        dispatcher is enabled (worker heartbeats keep it so) and its groups take `task`.
        `-E` / worker_send_task_events leaves the groups empty (every group); without it
        they are {'worker'} until the remote-control command `enable_events` (Flower
        sends it when it starts, and every 5 s) adds 'task', and `disable_events` takes
        it out. The dispatcher is replaced on a reconnect, its groups carried over, so
        this is read each time rather than kept: a few attribute loads."""
        dispatcher = self.loop.event_dispatcher
        if dispatcher is None or not dispatcher.enabled:
            return False
        groups = dispatcher.groups
        return not groups or "task" in groups

    def event(self, kind: str, task_id: str, **fields: Any) -> None:
        """Send a task event (`task-received`, ...) if task events are on. A caller that
        builds costly fields checks `task_events` first."""
        if self.task_events:
            self._event(kind, task_id, **fields)

    def _event(self, kind: str, task_id: str, **fields: Any) -> None:
        dispatcher = self.loop.event_dispatcher
        # Celery buffers task events and flushes them on the loop's next turn; a batch
        # of requests sends three events each, so let one flush carry them all.
        dispatcher.buffer_limit = EVENT_BUFFER_LIMIT
        dispatcher.send(kind, utcoffset=self._utcoffset, uuid=task_id, **fields)

    def _utcoffset(self) -> int:
        # Celery asks the OS for the UTC offset on every event; once a minute will do.
        now = time.monotonic()
        if now >= self._utcoffset_until:
            self._utcoffset_value = utcoffset()
            self._utcoffset_until = now + 60.0
        return self._utcoffset_value

    def forward(self, deliveries: list[Delivery], routing_key: str, body: bytes,
                headers: dict[str, Any], expiration_s: float | None) -> None:
        """Publish a message of requests handed on (returned members of coalesced messages)
        to a queue; each request is settled when the broker confirms it."""
        properties: dict[str, Any] = {"content_type": CONTENT_TYPE,
                                      "content_encoding": CONTENT_ENCODING,
                                      "application_headers": headers, "delivery_mode": 2}
        reply_to = deliveries[0].reply_to if deliveries else None
        if reply_to:
            properties["reply_to"] = reply_to
        if expiration_s is not None:
            properties["expiration"] = str(max(1, int(expiration_s * 1000)))
        self._publish(amqp.Message(body, **properties), routing_key, deliveries)

    def _answer(self, delivery: Delivery, task_id: str, payload: dict[str, Any]) -> None:
        reply_to = delivery.reply_to
        if not reply_to:  # fire-and-forget: nobody waits for a result
            delivery.settle()
            return
        if self._batching and delivery.reply_batch:
            self._bundles.setdefault(reply_to, []).append((payload, delivery))
            return
        body = msgpack.packb(payload, use_bin_type=True)
        self._send(reply_to, task_id, body, [delivery])

    def _send(self, reply_to: str, correlation_id: str, body: bytes,
              deliveries: list[Delivery], headers: dict[str, Any] | None = None) -> None:
        self._publish(amqp.Message(body, content_type=CONTENT_TYPE,
                                   content_encoding=CONTENT_ENCODING,
                                   correlation_id=correlation_id,
                                   application_headers=headers or {}),
                      reply_to, deliveries)

    def _publish(self, message: amqp.Message, routing_key: str,
                 deliveries: list[Delivery]) -> None:
        try:
            self.channel.basic_publish(message, exchange="", routing_key=routing_key)
        except Exception:
            # Left unacked, the messages come back once the connection is re-established.
            log.exception("could not publish for %d requests; they will be redelivered",
                          len(deliveries))
            return
        self._published += 1
        self._unconfirmed[self._published] = deliveries

    # --- confirms -------------------------------------------------------------------------

    def _confirmed(self, tag: int, multiple: bool) -> list[list[Delivery]]:
        tags = [t for t in self._unconfirmed if t <= tag] if multiple else [tag]
        return [self._unconfirmed.pop(t) for t in tags if t in self._unconfirmed]

    def _on_ack(self, tag: int, multiple: bool) -> None:
        for deliveries in self._confirmed(tag, multiple):
            for delivery in deliveries:
                delivery.settle()
        self.on_confirmed()

    def _on_nack(self, tag: int, multiple: bool) -> None:
        # The broker lost what was published: run those requests again.
        for deliveries in self._confirmed(tag, multiple):
            log.warning("broker refused a publish for %d requests; requeueing their messages",
                        len(deliveries))
            for delivery in deliveries:
                delivery.requeue()
        self.on_confirmed()
