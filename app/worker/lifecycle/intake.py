"""Intake: a delivered message becomes held requests, each placed where it waits.

Life of a request: delivered -> held (body not decoded; headers carry the cost) -> placed:
into the scheduler's lane of its model (`batching.scheduler`), or the feeder of a
continuously batching runtime (`batching.feeder`); first, if need be, its claimed
inputs are fetched (header `shoal_claims`, see `tasks.claims`: on `app.worker.lifecycle.claims`'s
threads; the bytes stay on its `Held`, its body keeps the claims, so a request given back
carries no bytes; its blobs are deleted once its message is acked), or it is parked until
its LoRA adapter is loaded (`app.worker.lifecycle.held`). A message delivered while draining goes
straight back (`app.worker.lifecycle.drain`).

A request for a model that is not loaded waits in its lane (which starts no batch) while
`app.worker.lifecycle.placement` loads the model beside the other models' batches; when the load
ends the lane runs, or its requests are answered MODEL_UNAVAILABLE. A request for a LoRA
adapter that is not loaded is parked (outside the scheduler) until its model and then its
adapter are loaded. Requests for different LoRAs of one model, and for none, batch
together: the runtime runs them in one forward pass (SHOAL_LORA_MIXED_BATCHES=false
batches each LoRA apart, to compare).

A message from a shoal gateway may carry several requests (coalesced, see
`tasks.envelope.coalesce`), its members: each is held, scheduled, answered and shown in
Flower on its own; the message is acked once all of them are settled
(`app.worker.lifecycle.replies.Delivery`).

`Intake` owns the reading (headers, coalesced members, annotations of a client that wrote
none, Flower's task-received) and decides what each request of a message becomes: placed
where it waits (`app.worker.lifecycle.entries`), its claims fetched first, refused (revoked
before it came), failed (a wrong queue, an unreadable body), or the whole message
dead-lettered. It returns those decisions (`app.worker.lifecycle.decisions`); the loop
(`app.worker.lifecycle.dispatcher`) applies them, with the loads and fetches they need, and
never calls back here: a message passes through this module once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.lifecycle import traces
from app.worker.lifecycle.batches import REVOKED_MESSAGE
from app.worker.lifecycle.claims import ClaimFetcher
from app.worker.lifecycle.decisions import Decision, Fail, Fetch, Refuse, Reject
from app.worker.lifecycle.entries import Clock, Entries
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.replies import Delivery, Replier
from tasks import tracing
from tasks.envelope import (
    H_COALESCED,
    Annotations,
    annotate,
    decode_body,
    now_ms,
    read_annotations,
    read_coalesced,
    with_trace,
)
from tasks.errors import ErrorCode
from tasks.names import ENCODE

log = logging.getLogger(__name__)


class Intake:
    """Delivered messages become decisions about their requests (loop thread)."""

    def __init__(self, entries: Entries, replier: Replier, claims: ClaimFetcher) -> None:
        self.entries = entries  # where a request waits, and the catalog
        self.replier = replier  # Flower's task-received
        self.claims = claims  # a claimed request's blobs are deleted once it is acked

    def take(self, message: Any) -> list[Decision]:
        """What becomes of each request a message carries, in its order (one `Reject`:
        the message cannot be read)."""
        headers = message.headers or {}
        task_name = headers.get("task", ENCODE)
        deliveries = 1 + int(headers.get("x-delivery-count") or 0)
        if H_COALESCED in headers:
            try:
                members = read_coalesced(headers, message.body)
            except ValueError:
                log.exception("coalesced message dead-lettered: it could not be read")
                return [Reject(message)]
            delivery = Delivery(message, len(members))
            # Its clocks, read once for all its requests (delivered together).
            clock = (time.monotonic(), now_ms())
            return [self._take(delivery, member.task_id, task_name, member.annotations,
                               member.body, deliveries, member.returns, clock)
                    for member in members]
        task_id = headers.get("id") or message.properties.get("correlation_id")
        if not task_id:
            log.error("message without a task id dead-lettered: %r", headers)
            return [Reject(message)]
        delivery = Delivery(message)
        annotations = read_annotations(headers)
        if annotations is None:  # a client that wrote no shoal headers
            try:
                kwargs = decode_body(message.body)
            except ValueError as exc:
                return [Fail(delivery, task_id, ErrorCode.INVALID_REQUEST, str(exc))]
            model = kwargs.get("model")
            entry = self.entries.entries.get(model) if isinstance(model, str) else None
            annotations = with_trace(annotate(task_name, kwargs, entry), headers)
        return [self._take(delivery, task_id, task_name, annotations, message.body,
                           deliveries, 0, None, headers)]

    def _take(self, delivery: Delivery, task_id: str, task_name: str,
              annotations: Annotations, body: bytes, deliveries: int, returns: int,
              clock: Clock | None, headers: dict[str, Any] | None = None) -> Decision:
        """What becomes of one request (the only one of its message, or a member of a
        coalesced one)."""
        held = Held(delivery, task_id, annotations, body, returns)
        if tracing.ENABLED:
            traces.received(annotations.model, held)
        if self.replier.task_events:  # off unless -E or Flower: no fields built then
            h = headers or {}
            self.replier.event(
                "task-received", task_id, name=task_name, args="()",
                kwargs=h.get("kwargsrepr") or
                f"{{'model': {annotations.model!r}, 'items': {annotations.items}}}",
                root_id=h.get("root_id", task_id), parent_id=h.get("parent_id"),
                retries=h.get("retries", 0), eta=None, expires=h.get("expires"))
        if annotations.claims:
            # Once acked (answered, whichever way), nobody needs its blobs any more.
            delivery.on_acked = [lambda: self.claims.delete(body)]
        model = annotations.model
        if model not in self.entries.lanes:  # a message routed to the wrong queue
            return Fail(delivery, task_id, ErrorCode.MODEL_NOT_FOUND,
                        f"this worker does not serve {model!r}")
        if task_id in worker_state.revoked:  # revoked before it came (`revokes`)
            metrics.REVOKED.labels(model, "arrived").inc()
            return Refuse(model, held, REVOKED_MESSAGE, ErrorCode.CANCELLED)
        if annotations.claims:
            return Fetch(model, held, deliveries + returns)
        return self.entries.place(model, held, deliveries + returns, clock)
