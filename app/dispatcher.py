"""The worker's dispatcher: holds delivered messages, forms batches, replies.

Everything here runs on the Celery consumer's event loop thread (kombu
channels are not thread-safe) except the batch itself, which runs on the
runtime's own thread; its completion is handed back with `hub.call_soon`,
which wakes the loop at once (no polling timer).

Life of a message: delivered -> held in its model's backlog (body not
decoded; headers carry the cost) -> taken into a batch -> result published
to `reply_to` -> acked. A message whose deadline passed before it ran gets a
DEADLINE_EXCEEDED failure and is acked without running.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from celery.app.task import Context

from batching.former import BatchLimits, Pending, seconds_to_wait, take_batch
from runtimes.base import Outcome, Request, Runtime
from tasks.envelope import Annotations, annotate, decode_body, now_ms, read_annotations
from tasks.errors import ErrorCode, ShoalError
from tasks.names import ENCODE

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Held:
    """A delivered, unacked message and what the dispatcher knows about it."""

    message: Any  # kombu.Message
    task_id: str
    task_name: str
    annotations: Annotations
    received_ms: int
    started: float = 0.0


class Dispatcher:
    def __init__(self, consumer: Any, runtime: Runtime, limits: dict[str, BatchLimits]) -> None:
        self.c = consumer
        self.app = consumer.app
        self.runtime = runtime
        self.limits = limits
        self.backlogs: dict[str, list[Pending]] = {model: [] for model in limits}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-runtime")
        self.running: Future | None = None
        self.last_finished: float | None = None
        self._timer: Any = None
        self._schedule_queued = False
        self.generation = 0  # bumped on connection loss: old messages cannot be acked

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
        held = Held(message, task_id, task_name, annotations, now_ms())  # type: ignore[arg-type]
        if annotations is None:
            try:
                annotations = annotate(task_name, decode_body(message.body))
            except ValueError as exc:
                self._reply_failure(held, ErrorCode.INVALID_REQUEST, str(exc))
                return
            held.annotations = annotations
        self._send_event("task-received", held, name=task_name, args="()",
                         kwargs=headers.get("kwargsrepr", ""), root_id=headers.get("root_id"),
                         parent_id=headers.get("parent_id"), retries=headers.get("retries", 0),
                         eta=None, expires=headers.get("expires"))
        backlog = self.backlogs.get(annotations.model)
        if backlog is None:  # a message routed to the wrong queue
            self._reply_failure(held, ErrorCode.MODEL_NOT_FOUND,
                                f"this worker does not serve {annotations.model!r}")
            return
        backlog.append(Pending(
            handle=held,
            group=(annotations.op, annotations.lora),
            items=annotations.items,
            cost=annotations.cost,
            longest=annotations.longest,
            received=time.monotonic(),
        ))
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
        if self.running is not None:
            return
        self._expire_overdue()
        model = self._next_model()
        if model is None:
            return
        backlog, limits = self.backlogs[model], self.limits[model]
        now = time.monotonic()
        wait = seconds_to_wait(backlog, limits, now, self.last_finished)
        if wait > 0:
            if self._timer is None:
                self._timer = self.c.hub.call_later(wait, self._on_timer)
            return
        batch = [p.handle for p in take_batch(backlog, limits)]
        started = time.time()
        for held in batch:
            held.started = started
            self._send_event("task-started", held)
        self.running = self.executor.submit(self._run, model, batch)
        generation = self.generation
        self.running.add_done_callback(
            lambda future: self.c.hub.call_soon(self._on_batch_done, generation, batch, future)
        )

    def _on_timer(self) -> None:
        self._timer = None
        self.schedule()

    def _next_model(self) -> str | None:
        """The model whose oldest held request has waited longest."""
        oldest = None
        for model, backlog in self.backlogs.items():
            if backlog and (oldest is None or backlog[0].received < oldest[1]):
                oldest = (model, backlog[0].received)
        return oldest[0] if oldest else None

    def _expire_overdue(self) -> None:
        now = now_ms()
        for backlog in self.backlogs.values():
            overdue = [p for p in backlog if _deadline_passed(p.handle, now)]
            if not overdue:
                continue
            backlog[:] = [p for p in backlog if not _deadline_passed(p.handle, now)]
            for pending in overdue:
                self._reply_failure(pending.handle, ErrorCode.DEADLINE_EXCEEDED,
                                    "the request's deadline passed before a worker could run it")

    # --- the batch (runtime thread) ------------------------------------------------------

    def _run(self, model: str, batch: list[Held]) -> list[Outcome]:
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
        return [outcomes[held.task_id] for held in batch]

    # --- completion (loop thread) --------------------------------------------------------

    def _on_batch_done(self, generation: int, batch: list[Held], future: Future) -> None:
        self.running = None
        self.last_finished = time.monotonic()
        try:
            outcomes = future.result()
        except Exception as exc:  # the runtime itself broke; every request gets an error
            log.exception("batch of %d failed", len(batch))
            outcomes = [Outcome(h.task_id, error_code=ErrorCode.INTERNAL,
                                error_message=f"runtime failed: {exc!r}") for h in batch]
        if generation == self.generation:
            for held, outcome in zip(batch, outcomes, strict=True):
                if outcome.ok:
                    self._reply_success(held, outcome.result)
                else:
                    self._reply_failure(held, outcome.error_code, outcome.error_message)
        # else: the connection was lost meanwhile; the messages are redelivered.
        self.schedule()

    def _request_context(self, held: Held) -> Context:
        props = held.message.properties
        return Context(
            id=held.task_id,
            reply_to=props.get("reply_to"),
            correlation_id=props.get("correlation_id") or held.task_id,
            ignore_result=False,
        )

    def _reply_success(self, held: Held, result: dict[str, Any] | None) -> None:
        assert result is not None
        now = now_ms()
        sent = held.annotations.sent_ms
        result["timing"] = {
            "queue_ms": max(0, int(held.started * 1000) - sent) if sent else None,
            "inference_ms": round(result.get("batch", {}).get("inference_ms", 0.0), 3),
        }
        if not self._publish(held, lambda ctx: self.app.backend.mark_as_done(
                held.task_id, result, request=ctx)):
            return
        held.message.ack()
        self._send_event("task-succeeded", held, result=f"<{result.get('count')} vectors>",
                         runtime=(now - held.started * 1000) / 1000 if held.started else 0.0)

    def _reply_failure(self, held: Held, code: str | None, message: str | None) -> None:
        error = ShoalError(code or ErrorCode.INTERNAL, message or "")
        if not self._publish(held, lambda ctx: self.app.backend.mark_as_failure(
                held.task_id, error, request=ctx, call_errbacks=False)):
            return
        held.message.ack()
        self._send_event("task-failed", held, exception=repr(error), traceback="")

    def _publish(self, held: Held, publish: Any) -> bool:
        """Publish a result; False (message left unacked) if the broker refused it."""
        ctx = self._request_context(held)
        if not ctx.reply_to:
            return True  # fire-and-forget: nobody waits for a result
        try:
            publish(ctx)
        except Exception:
            log.exception("could not publish the result of %s; it will be redelivered",
                          held.task_id)
            return False
        return True

    def _send_event(self, kind: str, held: Held, **fields: Any) -> None:
        dispatcher = getattr(self.c, "event_dispatcher", None)
        if dispatcher is not None and dispatcher.enabled:
            dispatcher.send(kind, uuid=held.task_id, **fields)

    # --- lifecycle -----------------------------------------------------------------------

    def drop_held(self) -> None:
        """Forget held messages after a connection loss (the broker redelivers them)."""
        self.generation += 1
        for backlog in self.backlogs.values():
            backlog.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.runtime.close()


def _deadline_passed(held: Held, now: int) -> bool:
    deadline = held.annotations.deadline_ms
    return deadline is not None and deadline <= now
