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
none, Flower's task-received) and the claims' fetch, and decides what each request becomes
where it waits: its first part if it is split (`first_part`), its scheduler entry
(`pending`), its feeder entry (`waiting`). The loop (`app.worker.lifecycle.dispatcher`)
places it, with the loads that needs: `Intake` hands it each request through the `place`
callback it is given, and asks it for a tick (`queue_tick`) once a fetch ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.lifecycle import traces
from app.worker.lifecycle.answers import Answers
from app.worker.lifecycle.batches import REVOKED_MESSAGE
from app.worker.lifecycle.claims import ClaimFetcher, Fetched
from app.worker.lifecycle.held import Held, Holdings
from app.worker.lifecycle.replies import Delivery, Replier
from app.worker.lifecycle.splits import split_request, too_long_for
from batching.feeder import Waiting
from batching.lanes import Lane
from batching.shapes import Pending
from tasks import tracing
from tasks.envelope import (
    H_COALESCED,
    Annotations,
    EstimatingEntry,
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

# The loop's: a request, its inputs at hand, goes where it waits (model, it, deliveries).
Place = Callable[[str, Held, int], None]


class Intake:
    """Delivered messages become held requests (loop thread)."""

    def __init__(self, lanes: dict[str, Lane], entries: dict[str, EstimatingEntry],
                 replier: Replier, answers: Answers, holdings: Holdings,
                 claims: ClaimFetcher, place: Place, queue_tick: Callable[[], None],
                 generation: Callable[[], int], part_target_s: float | None,
                 lora_mixed_batches: bool) -> None:
        self.lanes = lanes  # the served models' scheduler lanes
        self.entries = entries  # to annotate a Celery client's message that came without
        self.replier = replier
        self.answers = answers
        self.holdings = holdings
        self.claims = claims
        self.place = place
        self.queue_tick = queue_tick
        self.generation = generation  # the loop's: a fetch that ends in a later one is void
        self.part_target_s = part_target_s  # the longest a part of a split request should run
        self.lora_mixed_batches = lora_mixed_batches
        # While a coalesced message is taken: its clocks (monotonic s, epoch ms), read once
        # for all its requests (delivered together) instead of once each.
        self._clock: tuple[float, int] | None = None

    def take(self, message: Any) -> bool:
        """Hold the requests a message carries, each handed to `place` (or to the claims'
        fetch first); False if none was (the message is settled already: dead-lettered
        or refused)."""
        headers = message.headers or {}
        task_name = headers.get("task", ENCODE)
        deliveries = 1 + int(headers.get("x-delivery-count") or 0)
        if H_COALESCED in headers:
            try:
                members = read_coalesced(headers, message.body)
            except ValueError:
                log.exception("coalesced message dead-lettered: it could not be read")
                message.reject(requeue=False)
                return False
            delivery = Delivery(message, len(members))
            self._clock = (time.monotonic(), now_ms())
            try:
                for member in members:
                    self._take(delivery, member.task_id, task_name, member.annotations,
                               member.body, deliveries, member.returns)
            finally:
                self._clock = None
            return True
        task_id = headers.get("id") or message.properties.get("correlation_id")
        if not task_id:
            log.error("message without a task id dead-lettered: %r", headers)
            message.reject(requeue=False)
            return False
        delivery = Delivery(message)
        annotations = read_annotations(headers)
        if annotations is None:  # a client that wrote no shoal headers
            try:
                kwargs = decode_body(message.body)
            except ValueError as exc:
                self.replier.failure(delivery, task_id, ErrorCode.INVALID_REQUEST, str(exc))
                return False
            entry = self.entries.get(kwargs.get("model"))  # type: ignore[arg-type]
            annotations = with_trace(annotate(task_name, kwargs, entry), headers)
        self._take(delivery, task_id, task_name, annotations, message.body, deliveries, 0,
                   headers)
        return True

    def _take(self, delivery: Delivery, task_id: str, task_name: str,
              annotations: Annotations, body: bytes, deliveries: int, returns: int,
              headers: dict[str, Any] | None = None) -> None:
        """Hold one request (the only one of its message, or a member of a coalesced
        one)."""
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
        if model not in self.lanes:  # a message routed to the wrong queue
            self.replier.failure(delivery, task_id, ErrorCode.MODEL_NOT_FOUND,
                                 f"this worker does not serve {model!r}")
            return
        if task_id in worker_state.revoked:  # revoked before it came (`revokes`)
            metrics.REVOKED.labels(model, "arrived").inc()
            self.answers.refuse(model, held, REVOKED_MESSAGE, ErrorCode.CANCELLED)
            return
        if annotations.claims:
            self._fetch_claims(model, held, deliveries + returns)
            return
        self.place(model, held, deliveries + returns)

    def _fetch_claims(self, model: str, held: Held, deliveries: int) -> None:
        """Fetch a request's claimed inputs (on the fetcher's threads) before it is placed:
        it enters the scheduler only when its inputs are here."""
        generation = self.generation()
        a = held.annotations
        self.holdings.fetch(model, held)

        def fetched(outcome: Fetched) -> None:  # on the loop
            if generation != self.generation():
                return  # the connection was lost: the message is redelivered
            if not self.holdings.fetched(held):
                return  # handed back when the drain began
            if outcome.error_code is not None:
                self.answers.refuse(model, held, outcome.error_message or "",
                                    ErrorCode(outcome.error_code))
                return
            held.blobs = outcome.blobs
            self.place(model, held, deliveries)
            self.queue_tick()

        self.claims.fetch(held.body, a.sent_ms, a.deadline_ms,
                          lambda: held.task_id in worker_state.revoked, fetched)

    # --- where a request waits: decisions the loop applies ------------------------------

    def first_part(self, model: str, held: Held) -> Held | None:
        """The request itself, or, if it is too big for one batch, its first part; None:
        a split request that cannot finish within its whole deadline, answered
        DEADLINE_TOO_SHORT here (`too_long_for`)."""
        split = split_request(held, self.lanes[model], self.entries.get(model),
                              self.part_target_s)
        if split is None:
            return held
        metrics.SPLIT.labels(model).inc()
        a = held.annotations
        why = too_long_for(split, None if a.deadline_ms is None or a.sent_ms is None
                           else (a.deadline_ms - a.sent_ms) / 1000)
        if why is not None:
            self.answers.refuse(model, held, why, ErrorCode.DEADLINE_TOO_SHORT)
            return None
        return split.part_held(held, 0)

    def pending(self, held: Held, deliveries: int) -> Pending:
        """A request's entry in its model's scheduler lane."""
        now, wall_ms = self._clock or (time.monotonic(), now_ms())
        annotations = held.annotations
        deadline = annotations.deadline_ms
        split = held.split is not None
        # Positional (in `Pending`'s field order): keywords cost 0.3 us more per request.
        return Pending(
            held,  # handle
            # group: parts batch only with parts: a short request batched with a part would
            # be padded to the part's length and wait as long as it. LoRAs mix (see above).
            (annotations.op, split) if self.lora_mixed_batches
            else (annotations.op, split, annotations.lora),
            annotations.items,
            annotations.cost,
            annotations.longest,
            now,  # received
            None if deadline is None else now + (deadline - wall_ms) / 1000,  # deadline
            None if deadline is None or annotations.sent_ms is None  # budget_s
            else (deadline - annotations.sent_ms) / 1000,
            deliveries,
            not split,  # returnable
            held.task_id,  # key
            annotations.bulk,
        )

    def waiting(self, held: Held, deliveries: int) -> Waiting:
        """A request's entry in a continuously batching runtime's feeder."""
        deadline = held.annotations.deadline_ms
        now, wall_ms = self._clock or (time.monotonic(), now_ms())
        return Waiting(held, now, None if deadline is None else now + (deadline - wall_ms) / 1000,
                       deliveries, key=held.task_id)
