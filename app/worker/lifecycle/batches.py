"""Running a batch: started on the loop, run on the runtime's thread, answered on the loop.

A batch the scheduler starts runs on the runtime's own thread (an executor of
`pipeline_depth` threads: a pipelined runtime takes the next batch while it computes
one); its bodies are decoded there, and its completion is handed back with
`hub.call_soon`, which wakes the loop at once (no polling timer). The next batch starts
before this one's answers are published, so the runtime computes while the loop publishes.
A batch's streamed output goes out through `app.worker.lifecycle.streams`, always before its
results; `cancel` revokes requests (see there).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.splits import next_parts
from batching.former import batch_tokens
from batching.scheduler import Batch
from runtimes.base import Outcome, Request
from runtimes.worker_side.pool import lora_key
from tasks.claims import substitute
from tasks.envelope import decode_body
from tasks.errors import ErrorCode, ShoalError
from tasks.served import batch_device_ms

if TYPE_CHECKING:
    from app.worker.lifecycle.dispatcher import Dispatcher

log = logging.getLogger(__name__)


class Batches:
    """The dispatcher's batches; a mixin of `Dispatcher`. `_run` and `_requests` run on
    the runtime's thread, the rest on the loop."""

    def _mark_started(self: Dispatcher, model: str, held: Held, started: float) -> None:
        """A request (or a part of one) begins to run: Flower's task-started, queue wait."""
        if held.part == 0:  # a split request starts with its first part
            held.started = started
            self.replier.event("task-started", held.task_id)
        sent_ms = held.annotations.sent_ms
        if sent_ms:
            metrics.QUEUE_WAIT.labels(model).observe(max(0.0, started - sent_ms / 1000))

    def _start(self: Dispatcher, batch: Batch) -> None:
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

    def _run(self: Dispatcher, model: str, batch: list[Held], generation: int
             ) -> tuple[list[Outcome], float | None]:
        started = time.perf_counter()
        requests, outcomes = self._requests(batch)
        on_deltas = self.streams.queuer(generation, batch) \
            if any(r.stream for r in requests) else None
        if requests:
            outcomes.update((o.id, o) for o in self.runtime.run_batch(model, requests, on_deltas))
        answered = [outcomes[held.task_id] for held in batch]
        # A batch none of which ran (revoked, refused while the runtime restarts, failed)
        # says nothing of how long one takes: its time is not taught to the cost model.
        ran = any(o.ok for o in answered)
        return answered, time.perf_counter() - started if ran else None

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

    def cancel(self: Dispatcher, task_ids: list[str]) -> list[str]:
        """Revoke requests (loop thread): one that has not started is answered CANCELLED
        when its batch comes; one that runs stops at its next token. The ids that were
        running here."""
        worker_state.revoked.update(task_ids)
        here = self.holdings.running_ids()
        hit = [t for t in task_ids if t in here]
        if hit:
            self.runtime.cancel(hit)
        return hit

    # --- completion (loop thread) --------------------------------------------------------

    def _on_batch_done(self: Dispatcher, generation: int, future: Future) -> None:
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

    def _batch_done(self: Dispatcher, generation: int, future: Future) -> None:
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
        # Each split request's next part joins the backlog, behind what arrived meanwhile.
        # Parts are never returned, so their delivery count does not matter.
        for part in next_parts(held, outcomes):
            self._append(model, part, 1)
        self.placement.kick()  # a queued load may fit now that this batch is done
        # Start the next batch before answering this one: the runtime computes
        # while the loop publishes results, instead of idling until they are out.
        self.tick()
        self.streams.publish()  # a stream's last deltas go before its result
        if generation == self.generation:
            self.replier.begin_batch()
            for h, outcome in zip(held, outcomes, strict=True):
                self.answers.answer(model, h, outcome)
            self.replier.end_batch()
        # else: the connection was lost meanwhile; the messages are redelivered.
