"""The worker's dispatcher: holds delivered messages, forms batches, replies.

Everything here runs on the Celery consumer's event loop thread (kombu
channels are not thread-safe) except the batch itself, which runs on the
runtime's own thread; its completion is handed back with `hub.call_soon`,
which wakes the loop at once (no polling timer).

Life of a message: delivered -> held in its model's backlog (body not
decoded; headers carry the cost) -> taken into a batch -> result published
to `reply_to` -> acked. On the way it may instead be
- expired: its deadline passed before it ran; it gets DEADLINE_EXCEEDED;
- returned: the work held here would not start within the hold horizon while
  other workers consume the queue; it goes back (reject + requeue) for them.
The pure decisions (which batch, what to return, how much to prefetch) live
in `batching/`; this module only applies them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from app import metrics
from app.replies import Replier
from batching.cost import BatchShape, CostModel
from batching.former import (
    BatchLimits,
    Pending,
    batch_tokens,
    seconds_to_wait,
    split_expired,
    take_batch,
)
from batching.hold import HoldLimits, overflow, target_prefetch
from runtimes.base import Outcome, Request, Runtime
from tasks.envelope import Annotations, annotate, decode_body, now_ms, read_annotations
from tasks.errors import ErrorCode
from tasks.names import ENCODE

log = logging.getLogger(__name__)

# Re-consuming to change prefetch costs two round trips: only for real changes.
PREFETCH_CHANGE_RATIO = 1.5
# How long a count of the queue's consumers stays fresh (returns need peers).
PEER_COUNT_TTL_S = 1.0


@dataclass(slots=True)
class Held:
    """A delivered, unacked message and what the dispatcher knows about it."""

    message: Any  # kombu.Message
    task_id: str
    annotations: Annotations
    started: float = 0.0  # epoch seconds when its batch started


@dataclass(slots=True)
class Lane:
    """One served model: its backlog, batching limits, cost model and consumer."""

    model: str
    limits: BatchLimits
    cost: CostModel
    backlog: list[Pending] = field(default_factory=list)
    consumer: Any = None  # kombu.Consumer of the model queue
    prefetch: int = 0
    count_peers: Callable[[], int] | None = None  # consumers of the queue, us included
    peers: int = 1
    peers_checked: float = float("-inf")


@dataclass(slots=True)
class Running:
    lane: Lane
    batch: list[Pending]
    started: float  # monotonic
    predicted_s: float
    future: Future


class Dispatcher:
    def __init__(self, consumer: Any, runtime: Runtime, lanes: dict[str, Lane],
                 hold: HoldLimits) -> None:
        self.c = consumer
        self.runtime = runtime
        self.lanes = lanes
        self.hold = hold
        self.replier = Replier(consumer)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-runtime")
        self.running: Running | None = None
        self.last_finished: float | None = None
        self._timer: Any = None
        self._overrun_timer: Any = None
        self._schedule_queued = False
        self.generation = 0  # bumped on connection loss: old messages cannot be acked

    def attach(self, model: str, consumer: Any, prefetch: int,
               count_peers: Callable[[], int]) -> None:
        lane = self.lanes[model]
        lane.consumer, lane.prefetch, lane.count_peers = consumer, prefetch, count_peers
        metrics.PREFETCH.labels(model).set(prefetch)

    # --- delivery (loop thread) ---------------------------------------------------------

    def on_message(self, message: Any) -> None:
        try:
            self._hold(message)
        except Exception:
            # Whatever a message holds, it must not take the consumer down.
            log.exception("message dead-lettered: it could not be held")
            message.reject(requeue=False)

    def _hold(self, message: Any) -> None:
        headers = message.headers or {}
        task_id = headers.get("id") or message.properties.get("correlation_id")
        task_name = headers.get("task", ENCODE)
        if not task_id:
            log.error("message without a task id dead-lettered: %r", headers)
            message.reject(requeue=False)
            return
        annotations = read_annotations(headers)
        if annotations is None:  # a client that wrote no shoal headers
            try:
                annotations = annotate(task_name, decode_body(message.body))
            except ValueError as exc:
                self.replier.failure(message, task_id, ErrorCode.INVALID_REQUEST, str(exc))
                return
        held = Held(message, task_id, annotations)
        self.replier.event("task-received", task_id, name=task_name, args="()",
                           kwargs=headers.get("kwargsrepr", ""), root_id=headers.get("root_id"),
                           parent_id=headers.get("parent_id"), retries=headers.get("retries", 0),
                           eta=None, expires=headers.get("expires"))
        lane = self.lanes.get(annotations.model)
        if lane is None:  # a message routed to the wrong queue
            self.replier.failure(message, task_id, ErrorCode.MODEL_NOT_FOUND,
                                 f"this worker does not serve {annotations.model!r}")
            return
        now = time.monotonic()
        deadline = annotations.deadline_ms
        lane.backlog.append(Pending(
            handle=held,
            group=(annotations.op, annotations.lora),
            items=annotations.items,
            cost=annotations.cost,
            longest=annotations.longest,
            received=now,
            deadline=None if deadline is None else now + (deadline - now_ms()) / 1000,
            deliveries=1 + int(headers.get("x-delivery-count") or 0),
        ))
        metrics.HELD.labels(lane.model).set(len(lane.backlog))
        self._queue_schedule()

    def _queue_schedule(self) -> None:
        # Let the loop finish reading the frames at hand first, so messages
        # delivered together land in one batch.
        if not self._schedule_queued:
            self._schedule_queued = True
            self.c.hub.call_soon(self.schedule)

    # --- scheduling (loop thread) --------------------------------------------------------

    def schedule(self) -> None:
        self._schedule_queued = False
        now = time.monotonic()
        self._expire(now)
        if self.running is None:
            lane = self._next_lane()
            if lane is not None:
                wait = seconds_to_wait(lane.backlog, lane.limits, now, self.last_finished)
                if wait <= 0:
                    self._start(lane, now)
                elif self._timer is None:
                    self._timer = self.c.hub.call_later(wait, self._on_timer)
        self._give_back(now)

    def _on_timer(self) -> None:
        self._timer = None
        self.schedule()

    def _next_lane(self) -> Lane | None:
        """The lane whose oldest held request has waited longest."""
        waiting = [lane for lane in self.lanes.values() if lane.backlog]
        return min(waiting, key=lambda lane: lane.backlog[0].received, default=None)

    def _expire(self, now: float) -> None:
        for lane in self.lanes.values():
            for pending in split_expired(lane.backlog, now):
                metrics.EXPIRED.labels(lane.model).inc()
                held: Held = pending.handle
                self.replier.failure(held.message, held.task_id, ErrorCode.DEADLINE_EXCEEDED,
                                     "the request's deadline passed before a worker could run it")

    def _start(self, lane: Lane, now: float) -> None:
        batch = take_batch(lane.backlog, lane.limits, lane.cost, now)
        shape = BatchShape.of(batch)
        predicted = lane.cost.predict(shape)
        started = time.time()
        sent = [p.handle.annotations.sent_ms for p in batch]
        for pending in batch:
            pending.handle.started = started
            self.replier.event("task-started", pending.handle.task_id)
        for sent_ms in sent:
            if sent_ms:
                metrics.QUEUE_WAIT.labels(lane.model).observe(max(0.0, started - sent_ms / 1000))
        tokens = batch_tokens(batch, lane.limits.padded)
        metrics.BATCH_REQUESTS.labels(lane.model).observe(len(batch))
        metrics.BATCH_ITEMS.labels(lane.model).observe(shape.items)
        metrics.BATCH_TOKENS.labels(lane.model).observe(tokens)
        metrics.BATCH_FILL.labels(lane.model).observe(min(1.0, tokens / lane.limits.max_tokens))
        metrics.HELD.labels(lane.model).set(len(lane.backlog))

        held = [p.handle for p in batch]
        future = self.executor.submit(self._run, lane.model, held)
        self.running = Running(lane, batch, now, predicted, future)
        generation = self.generation
        future.add_done_callback(
            lambda f: self.c.hub.call_soon(self._on_batch_done, generation, f)
        )
        # If the batch overruns its prediction, look again at what we hold then.
        self._overrun_timer = self.c.hub.call_later(
            max(predicted * 1.5, 0.05), self._on_overrun, future)

    def _on_overrun(self, future: Future) -> None:
        running = self.running
        if running is None or running.future is not future:
            return
        self._give_back(time.monotonic())
        self._overrun_timer = self.c.hub.call_later(
            max(running.predicted_s, 0.25), self._on_overrun, future)

    def _running_left(self, now: float) -> float:
        """Predicted seconds until the running batch ends; past its prediction, assume it
        overruns by as much again as it already has."""
        running = self.running
        if running is None:
            return 0.0
        elapsed = now - running.started
        return max(running.predicted_s - elapsed, elapsed - running.predicted_s, 0.0)

    # --- giving work back (loop thread) -------------------------------------------------

    def _give_back(self, now: float) -> None:
        running_left = self._running_left(now)
        for lane in self.lanes.values():
            if not lane.backlog or self._peers(lane, now) < 2:
                continue  # nobody else would take it: returning would only loop back here
            returned = overflow(lane.backlog, lane.limits, self.hold, lane.cost,
                                running_left, now)
            if not returned:
                continue
            ids = {id(p) for p in returned}
            lane.backlog[:] = [p for p in lane.backlog if id(p) not in ids]
            # Shrink our credit first, so the broker offers them to the others.
            self._set_prefetch(lane, max(self.hold.min_prefetch, len(lane.backlog)))
            for pending in returned:
                pending.handle.message.reject(requeue=True)
            metrics.RETURNS.labels(lane.model).inc(len(returned))
            metrics.HELD.labels(lane.model).set(len(lane.backlog))
            log.info("returned %d requests of %s to the queue", len(returned), lane.model)

    def _peers(self, lane: Lane, now: float) -> int:
        if lane.count_peers is not None and now - lane.peers_checked > PEER_COUNT_TTL_S:
            try:
                lane.peers = lane.count_peers()
            except Exception:
                log.warning("could not count the consumers of %s", lane.model, exc_info=True)
            lane.peers_checked = now
        return lane.peers

    def _set_prefetch(self, lane: Lane, prefetch: int) -> None:
        """Re-consume with a new per-consumer prefetch (it applies to new consumers only)."""
        consumer = lane.consumer
        if consumer is None or prefetch == lane.prefetch:
            return
        consumer.cancel()
        consumer.qos(prefetch_count=prefetch)
        consumer.consume()
        lane.prefetch = prefetch
        metrics.PREFETCH.labels(lane.model).set(prefetch)

    def _adapt_prefetch(self, lane: Lane) -> None:
        target = target_prefetch(lane.backlog, lane.limits, self.hold, lane.cost,
                                 default=lane.prefetch or self.hold.max_prefetch)
        ratio = max(target, 1) / max(lane.prefetch, 1)
        if ratio >= PREFETCH_CHANGE_RATIO or ratio <= 1 / PREFETCH_CHANGE_RATIO:
            self._set_prefetch(lane, target)

    # --- the batch (runtime thread) ------------------------------------------------------

    def _run(self, model: str, batch: list[Held]) -> tuple[list[Outcome], float]:
        started = time.perf_counter()
        requests: list[Request] = []
        undecodable: dict[str, Outcome] = {}
        for held in batch:
            try:
                kwargs = decode_body(held.message.body)
            except ValueError as exc:
                undecodable[held.task_id] = Outcome(
                    held.task_id, error_code=ErrorCode.INVALID_REQUEST, error_message=str(exc))
                continue
            requests.append(Request(held.task_id, held.annotations.op, kwargs))
        outcomes = {o.id: o for o in self.runtime.run_batch(model, requests)} if requests else {}
        outcomes.update(undecodable)
        return [outcomes[held.task_id] for held in batch], time.perf_counter() - started

    # --- completion (loop thread) --------------------------------------------------------

    def _on_batch_done(self, generation: int, future: Future) -> None:
        running = self.running
        if running is None or running.future is not future:
            return
        self.running = None
        self.last_finished = time.monotonic()
        if self._overrun_timer is not None:
            self._overrun_timer.cancel()
            self._overrun_timer = None
        # Start the next batch before answering this one: the runtime computes
        # while the loop publishes results, instead of idling until they are out.
        self.schedule()
        lane, batch = running.lane, [p.handle for p in running.batch]
        try:
            outcomes, seconds = future.result()
            lane.cost.observe(BatchShape.of(running.batch), seconds)
            metrics.BATCH_SECONDS.labels(lane.model).observe(seconds)
        except Exception as exc:  # the runtime itself broke; every request gets an error
            log.exception("batch of %d failed", len(batch))
            outcomes = [Outcome(h.task_id, error_code=ErrorCode.INTERNAL,
                                error_message=f"runtime failed: {exc!r}") for h in batch]
        if generation == self.generation:
            self.replier.begin_batch()
            for held, outcome in zip(batch, outcomes, strict=True):
                self._answer(lane, held, outcome)
            self.replier.end_batch()
            self._adapt_prefetch(lane)
        # else: the connection was lost meanwhile; the messages are redelivered.

    def _answer(self, lane: Lane, held: Held, outcome: Outcome) -> None:
        if not outcome.ok:
            metrics.RESULTS.labels(lane.model, outcome.error_code or "error").inc()
            self.replier.failure(held.message, held.task_id, outcome.error_code,
                                 outcome.error_message)
            return
        result = outcome.result
        assert result is not None
        sent = held.annotations.sent_ms
        result["timing"] = {
            "queue_ms": max(0, int(held.started * 1000) - sent) if sent else None,
            "inference_ms": round(result.get("batch", {}).get("inference_ms", 0.0), 3),
        }
        result["worker"] = self.c.hostname
        metrics.RESULTS.labels(lane.model, "ok").inc()
        self.replier.success(held.message, held.task_id, result, time.time() - held.started)

    # --- lifecycle -----------------------------------------------------------------------

    def drop_held(self) -> None:
        """Forget held messages after a connection loss (the broker redelivers them)."""
        self.generation += 1
        for lane in self.lanes.values():
            lane.backlog.clear()
            lane.consumer = None
            metrics.HELD.labels(lane.model).set(0)
        for timer in (self._timer, self._overrun_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._overrun_timer = None

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.runtime.close()
