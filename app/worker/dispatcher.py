"""The worker's dispatcher: the kombu glue around the scheduler.

Everything here runs on the Celery consumer's event loop thread (kombu
channels are not thread-safe) except the batch itself, which runs on the
runtime's own thread; its completion is handed back with `hub.call_soon`,
which wakes the loop at once (no polling timer).

Life of a request: delivered -> held by the scheduler (body not decoded;
headers carry the cost) -> taken into a batch -> result published to
`reply_to` -> its message acked. On the way it may instead be answered
DEADLINE_EXCEEDED (its deadline passed, or would pass before its batch ends)
or returned to the queue for other workers. Every one of those decisions is
`batching.scheduler.Scheduler`'s; this module only feeds it events and
applies its `Actions`: acks, rejects, consumer cancel/qos/consume, peer
counts, Flower events and metrics.

A message from a shoal gateway may carry several requests (coalesced, see
`tasks.envelope.coalesce`). Each is held, scheduled, answered and shown in
Flower on its own; the message is acked once all of them are settled
(`app.worker.replies.Delivery`). Requests of it that the scheduler gives back go
back whole (reject + requeue) when nothing else of the message has been
settled, else they are republished as a message of their own before the
original is acked: a message cannot be requeued in part.

A request for a model that is not loaded waits in its lane (which starts no batch)
while `app.worker.placement` loads the model beside the other models' batches; when the
load ends the lane runs, or its requests are answered MODEL_UNAVAILABLE. Each
model queue's consumer has a RabbitMQ consumer priority (`x-priority`) that says
whether the model is loaded here, so the broker gives a model's traffic to the
workers that hold it and reaches a cold one only when they have no free prefetch;
a cold consumer takes one message at a time (the one that starts its load).
A request for a LoRA adapter that is not loaded is parked (outside the scheduler)
until its model and then its adapter are loaded. Requests for different LoRAs of
one model, and for none, batch together: the runtime runs them in one forward
pass (SHOAL_LORA_MIXED_BATCHES=false batches each LoRA apart, to compare).

Streaming: a generate request whose kwargs say `stream: true` has its output
published as it is made, as Celery PROGRESS states on its `reply_to` before its
result (`app.worker.replies.Replier.progress`). The runtime's thread queues each step's
deltas and wakes the loop, which publishes them in order, and always before the
batch's results. A request revoked by its caller (Celery's `revoke`, or
`shoal_cancel`, which a gateway sends when an HTTP stream's client leaves) is
answered CANCELLED if it has not started, and stops at its next token if it runs.

A model whose runtime batches continuously (SGLang, `Runtime.continuous`) gets no
batches from the scheduler: its requests are handed to the runtime one by one as
it has room (`app.worker.feeder`), each answered when it ends.

A request whose images were claim-checked (header `shoal_claims`, see
`tasks.claims`) enters the scheduler only once `app.worker.claims` has fetched and
checked its blobs, on threads of its own; the bytes stay on its `Held` (its
body keeps the claims, so a request given back carries no bytes) and are put
in place when the batch's bodies are decoded. A blob that never comes fails
that request alone (BLOB_MISSING, BLOB_CORRUPT). Its blobs are deleted once its
message is acked.

Draining for a shutdown (`begin_drain`, see `app.worker.shutdown`): the model queues'
consumers are cancelled, every request that has not started is handed back at
once (requeued whole, or republished when its message is partly settled or a
requeue would bring it near the delivery limit), and what runs goes on: the
running batch, the later parts of a split request whose first part ran, the
requests a continuous runtime is generating. Their results are published, and
`on_drained` is called once the broker has confirmed every publish (their
messages are then acked). A message delivered meanwhile goes straight back.

A request too big for one batch of its model is split into budget-sized
parts (`tasks.split`) that run one after another: the next part joins the
backlog when the previous one ends, so requests that arrived meanwhile go
first and nobody waits behind one long batch. The caller is answered once,
with the parts' results joined in order (or the first part's error).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.claims import ClaimFetcher, Fetched
from app.worker.feeder import Feeder, Waiting
from app.worker.placement import Placement
from app.worker.replies import Delivery, Replier
from batching.former import batch_tokens
from batching.hold import HoldLimits
from batching.parts import items_per_part
from batching.scheduler import Actions, Batch, Lane, Scheduler
from batching.shapes import Pending
from runtimes.base import CANCELLED, Delta, OnDeltas, Outcome, Request, Runtime
from runtimes.pool import Pool, lora_key
from tasks.claims import substitute
from tasks.envelope import (
    H_COALESCED,
    H_DEADLINE,
    Annotations,
    EstimatingEntry,
    Part,
    annotate,
    coalesce,
    decode_body,
    now_ms,
    read_annotations,
    read_coalesced,
    task_body,
)
from tasks.errors import ErrorCode, ShoalError
from tasks.names import ENCODE
from tasks.pool_state import COLD, LOADING, RESIDENT
from tasks.served import batch_device_ms, read_served, stamp_delivery, stamp_parts
from tasks.split import SPLITTABLE, merge_results, split_kwargs

log = logging.getLogger(__name__)

# How long a count of the queue's consumers stays fresh (returns need peers).
PEER_COUNT_TTL_S = 1.0
# How often a continuous runtime without room is asked again for its load.
FEED_POLL_S = 0.05
# A wake-up this close to the one already set needs no new timer.
TIMER_SLACK_S = 0.001


@dataclass(slots=True)
class Held:
    """A delivered request not yet settled, and what the dispatcher knows about it."""

    delivery: Delivery  # the message it came in (with others, if coalesced)
    task_id: str
    annotations: Annotations
    body: bytes  # its Celery body, decoded only on the runtime's thread
    returns: int = 0  # times a worker handed it on (republished) before
    started: float = 0.0  # epoch seconds when its batch started
    split: Split | None = None  # set on each part of a request run in parts
    part: int = 0  # which part
    # Its claim-checked inputs by key, once fetched (`body` keeps the claims: a request
    # given back must carry them, never the bytes); put in place by `_requests`.
    blobs: dict[str, bytes] | None = None


@dataclass(slots=True)
class Split:
    """A request run as parts, one at a time; answered once, when all are done."""

    parts: list[tuple[Annotations, bytes]]  # each part's annotations and Celery body
    results: list[dict[str, Any]] = field(default_factory=list)  # of the parts done
    inference_ms: float = 0.0  # summed over the parts' batches
    answered: bool = False

    def part_held(self, whole: Held, index: int) -> Held:
        annotations, body = self.parts[index]
        return Held(whole.delivery, whole.task_id, annotations, body, whole.returns,
                    whole.started, self, index, whole.blobs)

    def describe(self, index: int) -> str:
        first = sum(a.items for a, _ in self.parts[:index])
        last = first + self.parts[index][0].items - 1
        items = f"item {first}" if first == last else f"items {first}-{last}"
        return f"{items} (part {index + 1} of {len(self.parts)})"


@dataclass(slots=True)
class Consuming:
    """The kombu side of one served model: its consumer and how to count its peers."""

    consumer: Any  # kombu.Consumer of the model queue
    queue: str
    count_peers: Callable[[], int]  # consumers of the queue, us included
    warm_peers: Callable[[], int]  # other workers that hold the model loaded
    peers: int = 1
    checked: float = float("-inf")
    priority: int = 0  # its x-priority


# Consumer priorities by the model's state here: the broker delivers to a lower one only
# while every higher one has no free prefetch.
PRIORITY = {RESIDENT: 10, LOADING: 5, COLD: 0}
# A model not loaded here takes one message at a time (the one that starts its load).
# Once its load is queued or running, its consumer takes the model's traffic as a loaded
# one would: else the broker hands the next request to a cold peer, which loads the same
# model too (measured: most loads of bench.pool's fleet were such duplicates).
COLD_PREFETCH = 1


ReturnKey = tuple[str, str | None, bool]  # operation, reply_to, reply_batch


def plan_returns(returned: list[Held], renew: Callable[[Delivery], bool] | None = None
                 ) -> tuple[list[Delivery], dict[ReturnKey, list[Held]]]:
    """How to give requests back: (messages to requeue whole, requests to republish).

    A message goes back whole (reject + requeue, which keeps its delivery count)
    when every request it carries is returned and none is settled, unless `renew`
    says its delivery count must not grow. A message cannot be requeued in part,
    so the returned requests of any other message are republished, grouped into
    one message per operation and caller (their replies go where the original's
    would have); each counts one more return.
    """
    by_delivery: dict[int, list[Held]] = {}
    for held in returned:
        by_delivery.setdefault(id(held.delivery), []).append(held)
    whole: list[Delivery] = []
    handed_on: dict[ReturnKey, list[Held]] = {}
    for helds in by_delivery.values():
        delivery = helds[0].delivery
        if delivery.untouched and len(helds) == delivery.requests and not (
                renew is not None and renew(delivery)):
            whole.append(delivery)
            continue
        for held in helds:
            key = (held.annotations.op, delivery.reply_to, delivery.reply_batch)
            handed_on.setdefault(key, []).append(held)
    return whole, handed_on


def merged_result(split: Split) -> dict[str, Any]:
    """A split request's result: its parts' joined; the inference time it reports is that
    of all its parts' batches."""
    result = merge_results(split.results)
    stamp_parts(result, split.inference_ms, len(split.parts))
    return result


class Dispatcher:
    def __init__(self, consumer: Any, runtime: Runtime, lanes: dict[str, Lane],
                 hold: HoldLimits, entries: dict[str, EstimatingEntry],
                 part_target_s: float | None = None, pool: Pool | None = None,
                 pinned: set[str] | None = None, prefetch: int = 64,
                 load_s: dict[str, float] | None = None,
                 lora_mixed_batches: bool = True, feed_return_after_s: float = 0.2,
                 blob_url: str = "", claim_upload_timeout_s: float = 10.0) -> None:
        self.c = consumer
        self.runtime = runtime
        self.prefetch = prefetch  # of a consumer whose model is loaded, before adapting
        self.lora_mixed_batches = lora_mixed_batches
        # Requests waiting for a LoRA adapter to load (and its model first), with their
        # delivery counts; they join the scheduler when it is loaded.
        self.parked: dict[tuple[str, str], list[tuple[Held, int]]] = {}
        self.entries = entries  # to annotate a Celery client's message that came without
        self.part_target_s = part_target_s  # the longest a part of a split request should run
        # A pipelined runtime takes the next batch while it computes one (its
        # `pipeline_depth`); each batch in flight waits for its answer on a thread here.
        depth = max(1, int(getattr(runtime, "pipeline_depth", 1)))
        self.scheduler = Scheduler(lanes, hold, self._peers, depth=depth)
        self.continuous = {model for model in lanes if runtime.continuous(model)}
        self.feeder = Feeder(feed_return_after_s, hold.delivery_limit)
        self.replier = Replier(consumer)
        self.executor = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="shoal-runtime")
        self.claims = ClaimFetcher(blob_url, claim_upload_timeout_s,
                                   lambda fn: self.c.hub.call_soon(fn))
        self.consuming: dict[str, Consuming] = {}
        self.futures: dict[Future, Batch] = {}  # of the batches in flight
        self.device_busy_s = 0.0  # the device's busy time in this worker's batches so far
        # Deltas the runtime's thread made, for the loop to publish in order:
        # (generation, the batch's requests by task id, one step's deltas).
        self._deltas: deque[tuple[int, dict[str, Held], list[Delta]]] = deque()
        self._timer: Any = None
        self._timer_at = 0.0
        self._tick_queued = False
        self.generation = 0  # bumped on connection loss: old messages cannot be acked
        self.on_placement: Callable[[], None] = lambda: None  # told when a model's state changes
        # Draining for a shutdown: nothing new is held, what runs finishes.
        self.draining = False
        self._drain_begun = False  # its hand-back is done: `on_drained` may be called
        self._drain_reported = False  # `on_drained` was called (or the drain was abandoned)
        self._answering = False  # answering (a batch's results, refusals): not drained yet
        self.on_drained: Callable[[], None] = lambda: None
        self.drain_answered = 0  # requests answered while draining
        self.drain_handed_back = 0  # requests handed back when the drain began, or after
        self.delivery_limit = hold.delivery_limit
        # Requests whose claimed inputs are being fetched (not yet in the scheduler).
        self.fetching: dict[int, tuple[str, Held]] = {}
        self.replier.on_confirmed = self.check_drained
        self.placement = Placement(
            runtime, pool or Pool(2**62), list(lanes), pinned or set(),
            lambda fn, *args: self.c.hub.call_soon(fn, *args), self._in_use,
            self._on_state, self._on_load_failed, load_s or {}, self._on_lora)
        for model, lane in lanes.items():
            lane.ready = self.placement.state(model) == RESIDENT

    def consume(self, model: str, consumer: Any, queue: str, count_peers: Callable[[], int],
                warm_peers: Callable[[], int]) -> None:
        """Start consuming a model's queue with the prefetch and priority of its state."""
        state = self.placement.state(model)
        prefetch = COLD_PREFETCH if state == COLD else self.prefetch
        self.consuming[model] = Consuming(consumer, queue, count_peers, warm_peers,
                                          priority=PRIORITY[state])
        self._reconsume(model, prefetch, PRIORITY[state], first=True)

    # --- delivery (loop thread) ---------------------------------------------------------

    def on_message(self, message: Any) -> None:
        if self.draining:
            # Delivered before the broker saw the consumer cancelled: straight back.
            self._refuse_delivery(message)
            return
        try:
            self._hold(message)
        except Exception:
            # Whatever a message holds, it must not take the consumer down.
            log.exception("message dead-lettered: it could not be held")
            message.reject(requeue=False)

    def _hold(self, message: Any) -> None:
        headers = message.headers or {}
        task_name = headers.get("task", ENCODE)
        deliveries = 1 + int(headers.get("x-delivery-count") or 0)
        if H_COALESCED in headers:
            try:
                parts = read_coalesced(headers, message.body)
            except ValueError:
                log.exception("coalesced message dead-lettered: it could not be read")
                message.reject(requeue=False)
                return
            delivery = Delivery(message, len(parts))
            for part in parts:
                self._take(delivery, part.task_id, task_name, part.annotations, part.body,
                           deliveries, part.returns)
            self._queue_tick()
            return
        task_id = headers.get("id") or message.properties.get("correlation_id")
        if not task_id:
            log.error("message without a task id dead-lettered: %r", headers)
            message.reject(requeue=False)
            return
        delivery = Delivery(message)
        annotations = read_annotations(headers)
        if annotations is None:  # a client that wrote no shoal headers
            try:
                kwargs = decode_body(message.body)
            except ValueError as exc:
                self.replier.failure(delivery, task_id, ErrorCode.INVALID_REQUEST, str(exc))
                return
            entry = self.entries.get(kwargs.get("model"))  # type: ignore[arg-type]
            annotations = annotate(task_name, kwargs, entry)
        self._take(delivery, task_id, task_name, annotations, message.body, deliveries, 0,
                   headers)
        self._queue_tick()

    def _take(self, delivery: Delivery, task_id: str, task_name: str,
              annotations: Annotations, body: bytes, deliveries: int, returns: int,
              headers: dict[str, Any] | None = None) -> None:
        """Hold one request (the only one of its message, or a part of a coalesced one)."""
        held = Held(delivery, task_id, annotations, body, returns)
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
        if model not in self.scheduler.lanes:  # a message routed to the wrong queue
            self.replier.failure(delivery, task_id, ErrorCode.MODEL_NOT_FOUND,
                                 f"this worker does not serve {model!r}")
            return
        if annotations.claims:
            self._fetch_claims(model, held, deliveries + returns)
            return
        self._place(model, held, deliveries + returns)

    def _fetch_claims(self, model: str, held: Held, deliveries: int) -> None:
        """Fetch a request's claimed inputs (on the fetcher's threads) before it is placed:
        it enters the scheduler only when its inputs are here."""
        generation = self.generation
        a = held.annotations
        self.fetching[id(held)] = (model, held)

        def fetched(outcome: Fetched) -> None:  # on the loop
            if generation != self.generation:
                return  # the connection was lost: the message is redelivered
            if self.fetching.pop(id(held), None) is None:
                return  # handed back when the drain began
            if outcome.error_code is not None:
                self._refuse(model, held, outcome.error_message or "",
                             ErrorCode(outcome.error_code))
                return
            held.blobs = outcome.blobs
            self._place(model, held, deliveries)
            self._queue_tick()

        self.claims.fetch(held.body, a.sent_ms, a.deadline_ms,
                          lambda: held.task_id in worker_state.revoked, fetched)

    def _place(self, model: str, held: Held, deliveries: int) -> None:
        """A held request (its inputs at hand) joins its model's feeder or scheduler."""
        if model in self.continuous:
            self._admit_continuous(model, held, deliveries)
            return
        split = self._split(held)
        if split is not None:
            metrics.SPLIT.labels(model).inc()
            held = split.part_held(held, 0)
        self._admit(model, held, deliveries)

    def _admit(self, model: str, held: Held, deliveries: int) -> None:
        """Into the scheduler, once what it needs is loaded (loads start here)."""
        lora = held.annotations.lora
        # Used recently = asked for recently: a popular model stays the most recent even
        # while its requests wait (or were handed to a peer), and so is evicted last.
        self.placement.touch(model)
        if lora is not None and not self.placement.lora_resident(model, lora):
            self.parked.setdefault((model, lora), []).append((held, deliveries))
            why = self.placement.ensure(model, lora)
            if why is not None:
                self._on_lora(model, lora, why)
            return
        self._append(model, held, deliveries)
        if not self.scheduler.lanes[model].ready:
            why = self.placement.ensure(model)
            if why is not None:
                self._on_load_failed(model, why)

    def _admit_continuous(self, model: str, held: Held, deliveries: int) -> None:
        self.placement.touch(model)
        deadline = held.annotations.deadline_ms
        now = time.monotonic()
        self.feeder.add(model, Waiting(
            held, now, None if deadline is None else now + (deadline - now_ms()) / 1000,
            deliveries, key=held.task_id))
        if self.placement.state(model) != RESIDENT:
            why = self.placement.ensure(model)
            if why is not None:
                self._on_load_failed(model, why)

    def _append(self, model: str, held: Held, deliveries: int) -> None:
        now = time.monotonic()
        annotations = held.annotations
        deadline = annotations.deadline_ms
        self.scheduler.append(model, Pending(
            handle=held,
            # Parts batch only with parts: a short request batched with a part would be
            # padded to the part's length and wait as long as it. LoRAs mix (see above).
            group=(annotations.op, held.split is not None) if self.lora_mixed_batches
            else (annotations.op, held.split is not None, annotations.lora),
            items=annotations.items,
            cost=annotations.cost,
            longest=annotations.longest,
            received=now,
            deadline=None if deadline is None else now + (deadline - now_ms()) / 1000,
            deliveries=deliveries,
            returnable=held.split is None,
            bulk=annotations.bulk,
            key=held.task_id,
        ))

    def _split(self, held: Held) -> Split | None:
        """The parts of a request too big for one batch of its model, or None."""
        a = held.annotations
        lane = self.scheduler.lanes[a.model]
        entry = self.entries.get(a.model)
        if a.op not in SPLITTABLE or a.items <= 1 or entry is None:
            return None
        bulk_slice = lane.limits.bulk_slice_s if a.bulk and \
            lane.callers_active(time.monotonic()) else None
        target = min((t for t in (self.part_target_s, lane.limits.latency_target_s,
                                  bulk_slice) if t is not None), default=None)
        per_part = items_per_part(a.items, a.longest, a.cost, lane.limits, lane.cost, target)
        if per_part >= a.items:
            return None
        try:
            kwargs = decode_body(held.body)
        except ValueError:
            return None  # runs whole, and is answered INVALID_REQUEST
        parts = []
        for part in split_kwargs(kwargs, per_part):
            items, cost, longest = entry.estimate(part)
            parts.append((Annotations(a.model, a.op, items, cost, longest, a.deadline_ms,
                                      a.sent_ms, a.lora, bulk=a.bulk), task_body(part)))
        return Split(parts)

    def _queue_tick(self) -> None:
        # Let the loop finish reading the frames at hand first, so messages delivered
        # together land in one batch. A timer due now, not `call_soon`: kombu's loop runs
        # what `call_soon` adds from its own thread only after its next poll returns, so
        # from a callback that itself came by `call_soon` (a load's end) the tick waited
        # for the next frame or timer (0.03-1.2 s measured after loads, bench.coldstart);
        # due timers fire before that poll.
        if not self._tick_queued:
            self._tick_queued = True
            self.c.hub.call_later(0, self.tick)

    # --- applying the scheduler's decisions (loop thread) -------------------------------

    def tick(self) -> None:
        self._tick_queued = False
        actions = self.scheduler.tick(time.monotonic())
        for wake in (self._expire_parked() if self.parked else None,
                     self._feed() if self.continuous else None):
            if wake is not None:
                actions.wake_in = wake if actions.wake_in is None else min(actions.wake_in, wake)
        if not self.draining:
            self._apply(actions)
            return
        # Its refusals (deadlines passed) are answers too: the drain ends after them all.
        answering, self._answering = self._answering, True
        try:
            self._apply(actions)
        finally:
            self._answering = answering
        if not answering:
            self.check_drained()

    def _expire_parked(self) -> float | None:
        """Answer the parked requests whose deadline passed (they wait for a LoRA outside
        the scheduler); seconds until the next such deadline, or None."""
        now = now_ms()
        soonest: float | None = None
        for key, waiting in list(self.parked.items()):
            kept = []
            for held, deliveries in waiting:
                deadline = held.annotations.deadline_ms
                if deadline is not None and deadline <= now:
                    self._refuse(key[0], held, "the request's deadline passed while its LoRA "
                                               "adapter was loading")
                    continue
                kept.append((held, deliveries))
                if deadline is not None:
                    soonest = deadline if soonest is None else min(soonest, deadline)
            if kept:
                self.parked[key] = kept
            else:
                del self.parked[key]
        return None if soonest is None else max((soonest - now) / 1000, TIMER_SLACK_S)

    # --- continuous runtimes (loop thread) -------------------------------------------------

    def _feed(self) -> float | None:
        """Answer what expired, give back what waited too long while a peer could take it,
        hand the runtime what it has room for; seconds until this must run again."""
        now = time.monotonic()
        for model, late in self.feeder.expired(now):
            self._refuse(model, late.handle,
                         "the request's deadline passed while it waited for the model")
        peers = {}
        poll: float | None = None
        for model in self.continuous:
            if not self.feeder.waiting.get(model):
                continue
            peers[model] = self._peers(model, now)
            back = self.feeder.returns(model, now, peers[model])
            if back:
                self._give_back(model, [w.handle for w in back])
                metrics.RETURNS.labels(model).inc(len(back))
            if self.placement.state(model) == RESIDENT:
                for waiting in self.feeder.take(model, self.runtime.load_of(model)):
                    self._submit(model, waiting.handle)
                if self.feeder.waiting.get(model):
                    # No room now: it frees as SGLang finishes requests (ours are answered
                    # here and tick again, but aborts and its KV cache are its own).
                    poll = FEED_POLL_S
            metrics.HELD.labels(model).set(len(self.feeder.waiting.get(model, ())))
        wake = self.feeder.wake_in(now, peers)
        return poll if poll is not None and (wake is None or poll < wake) else wake

    def _submit(self, model: str, held: Held) -> None:
        """Hand one request to the continuous runtime; its outcome comes back on the loop."""
        requests, refused = self._requests([held])
        if refused:
            self._answer(model, held, refused[held.task_id])
            return
        (request,) = requests
        generation = self.generation
        self._mark_started(model, held, time.time())
        self.placement.touch(model)
        self.feeder.started(model, held.task_id, held)
        metrics.IN_FLIGHT.labels(model).set(len(self.feeder.in_flight[model]))
        on_deltas = self._delta_queuer(generation, [held]) if request.stream else None
        future = self.runtime.submit(model, request, on_deltas)  # type: ignore[attr-defined]
        future.add_done_callback(lambda f: self.c.hub.call_soon(
            self._on_request_done, generation, model, held, f))

    def _on_request_done(self, generation: int, model: str, held: Held, future: Future) -> None:
        self._publish_deltas()  # its last deltas go before its result
        self.feeder.done(model, held.task_id)
        metrics.IN_FLIGHT.labels(model).set(len(self.feeder.in_flight.get(model, {})))
        try:
            outcome: Outcome = future.result()
        except Exception as exc:  # the contract says never; a bug must not lose the request
            log.exception("the runtime failed request %s", held.task_id)
            outcome = Outcome(held.task_id, error_code=ErrorCode.INTERNAL,
                              error_message=f"runtime failed: {exc!r}")
        if generation == self.generation:
            answering, self._answering = self._answering, True
            try:
                self._answer(model, held, outcome)
            finally:
                self._answering = answering
        self._queue_tick()  # a slot is free: hand over the next
        self.check_drained()

    def _apply(self, actions: Actions) -> None:
        for model, pending in actions.expired:
            self._refuse(model, pending.handle,
                         "the request's deadline passed before a worker could run it")
        for model, late in actions.late:
            self._refuse(model, late.pending.handle,
                         f"the request's deadline is {late.deadline_in_s * 1000:.0f} ms away and "
                         f"its batch is predicted to take {late.predicted_s * 1000:.0f} ms: "
                         "not started; allow more time (X-Timeout-Ms) or send fewer items")
        if actions.start is not None:
            self._start(actions.start)
        for model, prefetch in actions.prefetch.items():
            self._set_prefetch(model, prefetch)
        for model, returned in actions.returned:
            self._give_back(model, [pending.handle for pending in returned])
            metrics.RETURNS.labels(model).inc(len(returned))
            log.info("returned %d requests of %s to the queue", len(returned), model)
        for lane in self.scheduler.lanes.values():
            metrics.HELD.labels(lane.model).set(len(lane.backlog))
        self._wake_in(actions.wake_in)

    def _refuse(self, model: str, held: Held, why: str,
                code: ErrorCode = ErrorCode.DEADLINE_EXCEEDED) -> None:
        if held.split is not None:
            if held.split.answered:
                return
            held.split.answered = True
            why = f"{held.split.describe(held.part)}: {why}"
        self._count_drain_answer(model)
        if code == ErrorCode.DEADLINE_EXCEEDED:
            metrics.EXPIRED.labels(model).inc()
        metrics.RESULTS.labels(model, code).inc()
        self.replier.failure(held.delivery, held.task_id, code, why)

    # --- placement (loop thread) -----------------------------------------------------------

    def _on_state(self, model: str, state: str) -> None:
        """A model became resident, loading or cold here: its lane and its consumer follow."""
        lane = self.scheduler.lanes[model]
        lane.ready = state == RESIDENT
        if lane.ready:
            now = time.monotonic()
            for pending in lane.backlog:
                metrics.LOAD_WAIT.labels(model).observe(now - pending.received)
        consuming = self.consuming.get(model)
        if consuming is not None:
            prefetch = COLD_PREFETCH if state == COLD else self.prefetch
            self._reconsume(model, prefetch, PRIORITY[state])
        self.on_placement()
        self._queue_tick()
        if lane.ready:
            for (parked_model, lora) in list(self.parked):
                if parked_model == model and (why := self.placement.ensure(model, lora)):
                    self._on_lora(model, lora, why)

    def _on_load_failed(self, model: str, why: str) -> None:
        for pending in self.scheduler.drop(model):
            self._refuse(model, pending.handle, why, ErrorCode.MODEL_UNAVAILABLE)
        for waiting in self.feeder.drop(model):
            self._refuse(model, waiting.handle, why, ErrorCode.MODEL_UNAVAILABLE)
        metrics.HELD.labels(model).set(0)
        for (parked_model, lora) in list(self.parked):
            if parked_model == model:
                self._on_lora(model, lora, why)

    def _on_lora(self, model: str, lora: str, why: str | None) -> None:
        """A LoRA adapter's load ended (why None: loaded): its parked requests go on."""
        for held, deliveries in self.parked.pop((model, lora), []):
            if why is None:
                self._append(model, held, deliveries)
            else:
                self._refuse(model, held, why, ErrorCode.MODEL_UNAVAILABLE)
        self.on_placement()
        self._queue_tick()

    def _in_use(self) -> Counter[str]:
        """Models and LoRA adapters (`lora_key`) that requests held, parked or running
        need, with how many: none of them may be evicted, and the queued load with the
        most requests waiting goes first."""
        used: Counter[str] = Counter()
        pendings = [p for lane in self.scheduler.lanes.values() for p in lane.backlog]
        pendings += [p for batch in self.scheduler.in_flight for p in batch.members]
        for pending in pendings:
            a = pending.handle.annotations
            used[a.model] += 1
            if a.lora is not None:
                used[lora_key(a.model, a.lora)] += 1
        for (model, lora), waiting in self.parked.items():
            used[model] += len(waiting)
            used[lora_key(model, lora)] += len(waiting)
        used.update(self.feeder.counts())
        return used

    def _give_back(self, model: str, returned: list[Held],
                   renew: Callable[[Delivery], bool] | None = None) -> None:
        """Return requests to their queue (see `plan_returns`)."""
        whole, handed_on = plan_returns(returned, renew)
        for delivery in whole:
            delivery.requeue()
        consuming = self.consuming.get(model)
        if consuming is None:  # not consuming (connection lost): redelivered anyway
            return
        for (op, _, reply_batch), helds in handed_on.items():
            parts = [Part(h.task_id, h.annotations, h.body, h.returns + 1) for h in helds]
            message = coalesce(model, op, parts, self.c.hostname, reply_batch)
            deadline_ms = message.headers.get(H_DEADLINE)  # its longest-lived request's
            expiration = None if deadline_ms is None else deadline_ms / 1000 - time.time()
            self.replier.forward([h.delivery for h in helds], consuming.queue, message.body,
                                 message.headers, expiration)

    def _wake_in(self, seconds: float | None) -> None:
        if seconds is None:
            return
        at = time.monotonic() + seconds
        if self._timer is not None:
            if abs(at - self._timer_at) <= TIMER_SLACK_S:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.c.hub.call_later(seconds, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.tick()

    def _peers(self, model: str, now: float) -> int:
        consuming = self.consuming.get(model)
        if consuming is None:
            return 1
        if now - consuming.checked > PEER_COUNT_TTL_S:
            try:
                consuming.peers = consuming.count_peers()
            except Exception:
                log.warning("could not count the consumers of %s", model, exc_info=True)
            consuming.checked = now
            # Peers that would first have to load the model are worth handing work to only
            # once it would wait here longer than that load.
            cold_only = consuming.peers > 1 and consuming.warm_peers() == 0
            self.scheduler.lanes[model].cold_peers_horizon_s = (
                self.placement.load_seconds(model) if cold_only else None)
        return consuming.peers

    def _set_prefetch(self, model: str, prefetch: int) -> None:
        consuming = self.consuming.get(model)
        if consuming is not None:
            self._reconsume(model, prefetch, consuming.priority)
        else:
            metrics.PREFETCH.labels(model).set(prefetch)

    def _reconsume(self, model: str, prefetch: int, priority: int, first: bool = False) -> None:
        """Consume again with a new per-consumer prefetch and priority (both apply to new
        consumers only)."""
        if self.draining:
            return  # consumers stay cancelled
        consuming = self.consuming[model]
        consumer = consuming.consumer
        if not first:
            consumer.cancel()
        consuming.priority = priority
        for queue in consumer.queues:
            queue.consumer_arguments = {"x-priority": priority}
        consumer.qos(prefetch_count=prefetch)
        consumer.consume()
        self.scheduler.prefetch_applied(model, prefetch)
        metrics.PREFETCH.labels(model).set(prefetch)

    def _mark_started(self, model: str, held: Held, started: float) -> None:
        """A request (or a part of one) begins to run: Flower's task-started, queue wait."""
        if held.part == 0:  # a split request starts with its first part
            held.started = started
            self.replier.event("task-started", held.task_id)
        sent_ms = held.annotations.sent_ms
        if sent_ms:
            metrics.QUEUE_WAIT.labels(model).observe(max(0.0, started - sent_ms / 1000))

    def _start(self, batch: Batch) -> None:
        model, limits = batch.lane.model, batch.lane.limits
        self.placement.touch(model)
        for lora in {p.handle.annotations.lora for p in batch.members} - {None}:
            self.placement.touch(lora_key(model, lora))
        started = time.time()
        for pending in batch.members:
            self._mark_started(model, pending.handle, started)
        tokens = batch_tokens(batch.members, limits.padded)
        metrics.BATCH_REQUESTS.labels(model).observe(len(batch.members))
        metrics.BATCH_ITEMS.labels(model).observe(batch.shape.items)
        metrics.BATCH_TOKENS.labels(model).observe(tokens)
        metrics.BATCH_FILL.labels(model).observe(min(1.0, tokens / limits.max_tokens))
        generation = self.generation
        future = self.executor.submit(self._run, model, [p.handle for p in batch.members],
                                      generation)
        self.futures[future] = batch
        future.add_done_callback(
            lambda f: self.c.hub.call_soon(self._on_batch_done, generation, f)
        )

    # --- the batch (runtime thread) ------------------------------------------------------

    def _run(self, model: str, batch: list[Held], generation: int
             ) -> tuple[list[Outcome], float]:
        started = time.perf_counter()
        requests, outcomes = self._requests(batch)
        on_deltas = self._delta_queuer(generation, batch) \
            if any(r.stream for r in requests) else None
        if requests:
            outcomes.update((o.id, o) for o in self.runtime.run_batch(model, requests, on_deltas))
        return [outcomes[held.task_id] for held in batch], time.perf_counter() - started

    @staticmethod
    def _requests(batch: list[Held]) -> tuple[list[Request], dict[str, Outcome]]:
        """The runtime's requests of a batch (bodies decoded here, on the runtime's thread),
        and the outcomes of those that cannot run: undecodable, or revoked meanwhile."""
        requests: list[Request] = []
        refused: dict[str, Outcome] = {}
        for held in batch:
            if held.task_id in worker_state.revoked:
                refused[held.task_id] = Outcome(
                    held.task_id, error_code=ErrorCode.CANCELLED,
                    error_message="the request was revoked by its caller before it ran")
                continue
            try:
                kwargs = decode_body(held.body)
            except ValueError as exc:
                refused[held.task_id] = Outcome(
                    held.task_id, error_code=ErrorCode.INVALID_REQUEST, error_message=str(exc))
                continue
            if held.blobs is not None:
                try:
                    substitute(kwargs, held.blobs)
                except ShoalError as exc:
                    refused[held.task_id] = Outcome(held.task_id, error_code=exc.code,
                                                    error_message=exc.message)
                    continue
            requests.append(Request(held.task_id, held.annotations.op, kwargs,
                                    stream=kwargs.get("stream") is True,
                                    deadline_ms=held.annotations.deadline_ms))
        return requests, refused

    def _delta_queuer(self, generation: int, batch: list[Held]) -> OnDeltas:
        """The batch's `on_deltas` (runtime thread): queue, and wake the loop to publish.
        Through one queue, as the loop runs `call_soon` callbacks in no set order."""
        by_id = {held.task_id: held for held in batch}

        def queue(deltas: list[Delta]) -> None:
            self._deltas.append((generation, by_id, deltas))
            self.c.hub.call_soon(self._publish_deltas)

        return queue

    # --- streams (loop thread) -----------------------------------------------------------

    def _publish_deltas(self) -> None:
        """Publish the queued deltas as PROGRESS states, in the order they were made, one per
        request and pass: the deltas of one item that queued up meanwhile go as one text. A
        request revoked meanwhile publishes no more and is cancelled in the runtime."""
        made: dict[str, tuple[Held, dict[int, dict[str, Any]]]] = {}
        while self._deltas:
            generation, by_id, deltas = self._deltas.popleft()
            if generation != self.generation:
                continue  # the connection was lost: these requests are redelivered
            for delta in deltas:
                held, items = made.setdefault(delta.id, (by_id[delta.id], {}))
                item = items.get(delta.index)
                if item is None:
                    items[delta.index] = {"index": delta.index, "text": delta.text,
                                          "tokens": delta.tokens}
                else:
                    item["text"] += delta.text
                    item["tokens"] = delta.tokens
        updates: list[tuple[Delivery, str, dict[str, Any]]] = []
        for task_id, (held, items) in made.items():
            if task_id in worker_state.revoked:
                self.runtime.cancel([task_id])
                continue
            updates.append((held.delivery, task_id,
                            {"choices": list(items.values()), "worker": self.c.hostname}))
            metrics.STREAM_DELTAS.labels(held.annotations.model).inc(len(items))
        if updates:
            self.replier.progress(updates)

    def cancel(self, task_ids: list[str]) -> list[str]:
        """Revoke requests (loop thread): one that has not started is answered CANCELLED
        when its batch comes; one that runs stops at its next token. The ids that were
        running here."""
        worker_state.revoked.update(task_ids)
        here = {p.handle.task_id for batch in self.scheduler.in_flight for p in batch.members}
        for in_flight in self.feeder.in_flight.values():
            here.update(in_flight)
        hit = [t for t in task_ids if t in here]
        if hit:
            self.runtime.cancel(hit)
        return hit

    # --- completion (loop thread) --------------------------------------------------------

    def _on_batch_done(self, generation: int, future: Future) -> None:
        if future not in self.futures:
            return
        # Until its answers are all published, the drain is not over, whatever is seen
        # meanwhile (confirms of the first answers read while the rest go out, a tick).
        self._answering = True
        try:
            self._batch_done(generation, future)
        finally:
            self._answering = False
        self.check_drained()

    def _batch_done(self, generation: int, future: Future) -> None:
        started = self.futures.pop(future)
        outcomes: list[Outcome] | None = None
        seconds: float | None = None
        failure: Exception | None = None
        try:
            outcomes, seconds = future.result()
        except Exception as exc:  # the runtime itself broke; every request gets an error
            failure = exc
        batch = self.scheduler.finish(time.monotonic(), seconds, started)
        assert batch is started
        model, held = batch.lane.model, [p.handle for p in batch.members]
        if outcomes is None:
            log.exception("batch of %d failed", len(held), exc_info=failure)
            outcomes = [Outcome(h.task_id, error_code=ErrorCode.INTERNAL,
                                error_message=f"runtime failed: {failure!r}") for h in held]
        else:
            if seconds is not None:
                metrics.BATCH_SECONDS.labels(model).observe(seconds)
            busy_ms = batch_device_ms(o.result for o in outcomes)
            if busy_ms is not None:
                metrics.DEVICE_BUSY.labels(model).inc(busy_ms / 1000)
                self.device_busy_s += busy_ms / 1000
        self._continue_splits(model, held, outcomes)
        self.placement.kick()  # a queued load may fit now that this batch is done
        # Start the next batch before answering this one: the runtime computes
        # while the loop publishes results, instead of idling until they are out.
        self.tick()
        self._publish_deltas()  # a stream's last deltas go before its result
        if generation == self.generation:
            self.replier.begin_batch()
            for h, outcome in zip(held, outcomes, strict=True):
                self._answer(model, h, outcome)
            self.replier.end_batch()
        # else: the connection was lost meanwhile; the messages are redelivered.

    def _continue_splits(self, model: str, helds: list[Held], outcomes: list[Outcome]) -> None:
        """Keep each split request's part result and put its next part in the backlog
        (behind what arrived meanwhile)."""
        for held, outcome in zip(helds, outcomes, strict=True):
            split = held.split
            if split is None or split.answered or not outcome.ok:
                continue
            assert outcome.result is not None
            split.results.append(outcome.result)
            split.inference_ms += (read_served(outcome.result).batch or {}).get(
                "inference_ms", 0.0)
            if len(split.results) < len(split.parts):
                # Parts are never returned, so their delivery count does not matter.
                self._append(model, split.part_held(held, len(split.results)), 1)

    def _answer(self, model: str, held: Held, outcome: Outcome) -> None:
        split = held.split
        if split is not None:
            if split.answered or (outcome.ok and len(split.results) < len(split.parts)):
                return  # answered already, or more parts to run
            split.answered = True
            if outcome.ok:
                outcome = Outcome(held.task_id, result=merged_result(split))
            else:
                outcome = Outcome(held.task_id, error_code=outcome.error_code,
                                  error_message=f"{split.describe(held.part)}: "
                                                f"{outcome.error_message}")
        self._count_drain_answer(model)
        if not outcome.ok:
            metrics.RESULTS.labels(model, outcome.error_code or "error").inc()
            if outcome.error_code == ErrorCode.CANCELLED:
                metrics.CANCELLED.labels(model).inc()
            self.replier.failure(held.delivery, held.task_id, outcome.error_code,
                                 outcome.error_message)
            return
        result = outcome.result
        assert result is not None
        sent = held.annotations.sent_ms
        stamp_delivery(result, round(max(0.0, held.started * 1000 - sent), 2) if sent else None,
                       self.c.hostname)
        metrics.RESULTS.labels(model, "ok").inc()
        if any(c.get("finish_reason") == CANCELLED for c in result.get("choices") or ()):
            metrics.CANCELLED.labels(model).inc()
        for latency in result.get("latency") or ():
            if "ttft_ms" in latency:
                metrics.TIME_TO_FIRST_TOKEN.labels(model).observe(latency["ttft_ms"] / 1000)
                metrics.INTER_TOKEN.labels(model).observe(latency["itl_ms"] / 1000)
        self.replier.success(held.delivery, held.task_id, result, time.time() - held.started)

    # --- draining for a shutdown (loop thread) ------------------------------------------

    def begin_drain(self) -> dict[str, int]:
        """Stop consuming, hand back every request that has not started; what runs goes
        on. The requests handed back, by model. `on_drained` is called once nothing runs
        and every publish is confirmed (`check_drained`: call it after this)."""
        self.draining = True
        for consuming in self.consuming.values():
            try:
                consuming.consumer.cancel()
            except Exception:  # a lost connection redelivers everything anyway
                log.warning("could not cancel the consumer of %s", consuming.queue,
                            exc_info=True)
        handed: dict[str, int] = {}
        for model in self.scheduler.lanes:
            back = self._not_started(model)
            if back:
                self._give_back(model, back, self._near_delivery_limit)
                metrics.HANDED_BACK.labels(model).inc(len(back))
                handed[model] = len(back)
            metrics.HELD.labels(model).set(len(self.scheduler.lanes[model].backlog))
        self.drain_handed_back += sum(handed.values())
        self._drain_begun = True
        return handed

    def _not_started(self, model: str) -> list[Held]:
        """Take out every request of `model` held here that has not started: in the
        backlog (but the later parts of a split request whose first part ran: it is
        answered once all have), waiting for a LoRA adapter or a continuous runtime's
        room, or for its claimed inputs."""
        back: list[Held] = []
        for pending in self.scheduler.drop(model):
            if pending.handle.part > 0:
                self.scheduler.append(model, pending)
            else:
                back.append(pending.handle)
        for key in [k for k in self.parked if k[0] == model]:
            back += [held for held, _ in self.parked.pop(key)]
        back += [waiting.handle for waiting in self.feeder.drop(model)]
        for key, (fetch_model, held) in list(self.fetching.items()):
            if fetch_model == model:
                del self.fetching[key]
                back.append(held)
        return back

    def _near_delivery_limit(self, delivery: Delivery) -> bool:
        """A requeue would bring it near the queue's delivery limit (quorum queues count
        every requeue): it is republished instead, as a new message."""
        deliveries = 1 + int((delivery.message.headers or {}).get("x-delivery-count") or 0)
        return self.delivery_limit >= 0 and deliveries > self.delivery_limit // 2

    def _refuse_delivery(self, message: Any) -> None:
        try:
            message.reject(requeue=True)
        except Exception:  # the channel is gone: the broker requeues it anyway
            log.warning("could not hand back a message delivered while draining",
                        exc_info=True)
        self.drain_handed_back += 1
        model = (message.headers or {}).get("shoal_model")
        if isinstance(model, str) and model in self.scheduler.lanes:
            metrics.HANDED_BACK.labels(model).inc()

    def _count_drain_answer(self, model: str) -> None:
        if self.draining:
            self.drain_answered += 1
            metrics.DRAIN_ANSWERED.labels(model).inc()

    @property
    def unfinished(self) -> int:
        """Requests running or bound to run here: the running batch, the parts of split
        requests left to run, the requests a continuous runtime is generating."""
        return (sum(len(batch.members) for batch in self.scheduler.in_flight)
                + sum(len(lane.backlog) for lane in self.scheduler.lanes.values())
                + sum(len(in_flight) for in_flight in self.feeder.in_flight.values()))

    @property
    def drained(self) -> bool:
        """Draining, nothing runs, nothing is held, every publish is confirmed."""
        return (self._drain_begun and not self._answering and not self.futures
                and self.unfinished == 0
                and not self.parked and not self.fetching
                and not any(self.feeder.waiting.values())
                and self.replier.unconfirmed == 0)

    def check_drained(self) -> None:
        """Call `on_drained` (once) if the drain is over."""
        if self.draining and not self._drain_reported and self.drained:
            self._drain_reported = True
            self.on_drained()

    def abandon(self) -> int:
        """A forced end: publish and ack nothing more (the broker redelivers it); the
        number of requests that were running."""
        unfinished = self.unfinished
        self._drain_reported = True
        self.drop_held()
        return unfinished

    # --- lifecycle -----------------------------------------------------------------------

    def drop_held(self) -> None:
        """Forget held messages after a connection loss (the broker redelivers them)."""
        self.generation += 1
        self.scheduler.clear()
        self.parked.clear()
        self.feeder.clear()
        self.fetching.clear()
        for model in self.scheduler.lanes:
            metrics.HELD.labels(model).set(0)
        self.consuming.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def close(self) -> None:
        self.claims.close()
        self.placement.close()
        # The runtime first: a batch still running (a forced or cold shutdown; a drained
        # worker runs none) fails at once instead of holding the exit up.
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.runtime.close()
        self.executor.shutdown(wait=True)
