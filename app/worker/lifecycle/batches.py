"""The batch runner: a batch started on the loop, run on the runtime's thread, finished on
the loop.

A batch the scheduler starts (`Batches.start`) runs on the runtime's own thread (an
executor of `pipeline_depth` threads: a pipelined runtime takes the next batch while it
computes one); its bodies are decoded there (`decode_requests`), and its completion is
handed back as the loop's `done` event through the loop handle (`call_soon`), which wakes
it at once (no polling timer). A lone small batch (nothing in flight, small bodies; a
runtime whose `capabilities.send_ahead` says it can) is decoded and sent to a runtime
process by the loop itself (`send_ahead`, which never waits), so the child
starts on it while the thread wakes up: the executor's hand-off is off a lone request's
path on the way in (measured 0.04-0.09 ms of it; the way back still takes the loop's
wake-up). `Batches.finish` turns a completed batch into its outcomes and teaches the
scheduler its time; what to do with them (the next parts, the next batch before these
answers, the answers) is the loop's (`app.worker.lifecycle.dispatcher`). A batch's streamed
output goes out through `app.worker.lifecycle.streams`, always before its results.

It owns the executor and the batches in flight, and nothing of the loop: it is given the
runtime, the scheduler, the placement (what a batch uses is touched), the streams, the
replier (Flower's task-started), the loop handle and the loop's event for a finished
batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.lifecycle import traces
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.loop import Loop
from app.worker.lifecycle.placement import Placement
from app.worker.lifecycle.replies import Replier
from app.worker.lifecycle.streams import Streams
from batching.former import batch_tokens
from batching.lanes import Batch
from batching.pool import lora_key
from batching.scheduler import Scheduler
from batching.shapes import BatchShape
from runtimes.base import Outcome, Request, Runtime, SentAhead
from tasks import tracing
from tasks.claims import substitute
from tasks.envelope import decode_body, now_ms
from tasks.errors import ErrorCode, ShoalError
from tasks.served import batch_device_ms

log = logging.getLogger(__name__)

# A batch whose bodies take more than this is decoded on the runtime's thread, never on
# the loop (a lone small one is decoded on the loop and sent ahead: `Batches.start`).
AHEAD_BODY_BYTES = 16 * 1024
# Why a revoked request is answered CANCELLED unrun (here, or where `revokes` finds it held).
REVOKED_MESSAGE = "the request was revoked by its caller before it ran"
# Outcomes of requests taken out of a batch before its device work (here or in the runtime).
DROPPED_BEFORE_DEVICE = frozenset({ErrorCode.CANCELLED, ErrorCode.DEADLINE_EXCEEDED})


def mark_started(replier: Replier, model: str, held: Held, started: float) -> None:
    """A request (or a part of one) begins to run: Flower's task-started, queue wait."""
    if held.part == 0:  # a split request starts with its first part
        held.started = started
        replier.event("task-started", held.task_id)
    sent_ms = held.annotations.sent_ms
    if sent_ms:
        metrics.QUEUE_WAIT.labels(model).observe(max(0.0, started - sent_ms / 1000))


def decode_requests(batch: list[Held]) -> tuple[list[Request], dict[str, Outcome]]:
    """The runtime's requests of a batch (bodies decoded here, on the runtime's thread,
    claimed inputs put in place), and the outcomes of those that cannot run: undecodable,
    revoked meanwhile, or past their deadline (a batch may wait for the runtime's thread
    behind the batches ahead: nobody waits for these answers any more)."""
    requests: list[Request] = []
    refused: dict[str, Outcome] = {}
    now = now_ms()
    for held in batch:
        if held.task_id in worker_state.revoked:
            refused[held.task_id] = Outcome(held.task_id, error_code=ErrorCode.CANCELLED,
                                            error_message=REVOKED_MESSAGE)
            continue
        deadline = held.annotations.deadline_ms
        if deadline is not None and deadline <= now:
            refused[held.task_id] = Outcome(
                held.task_id, error_code=ErrorCode.DEADLINE_EXCEEDED,
                error_message="the request's deadline passed before its batch reached the "
                              "runtime")
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
                                deadline_ms=held.annotations.deadline_ms,
                                trace=held.batch_trace))
    return requests, refused


class Batches:
    """The batches in flight. `_run` runs on the runtime's thread, the rest on the loop."""

    def __init__(self, runtime: Runtime, scheduler: Scheduler, placement: Placement,
                 streams: Streams, replier: Replier, loop: Loop, depth: int,
                 done: Callable[[int, Future], None]) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.placement = placement
        self.streams = streams
        self.replier = replier
        self.loop = loop  # wakes the loop when a batch is done
        self.done = done  # the loop's: (generation, future), on the loop
        self.executor = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="shoal-runtime")
        # Whether a lone batch's frame may be sent from the loop (read once).
        self.send_ahead = runtime.capabilities.send_ahead
        self.futures: dict[Future, Batch] = {}  # of the batches in flight
        self.device_busy_s = 0.0  # the device's busy time in this worker's batches so far

    @property
    def idle(self) -> bool:
        """No batch in flight."""
        return not self.futures

    def start(self, batch: Batch, generation: int) -> None:
        """Hand a batch the scheduler started to the runtime's thread; `done` is called on
        the loop when it ends."""
        model, limits = batch.lane.model, batch.lane.limits
        held = [p.handle for p in batch.members]
        started = time.time()
        if tracing.ENABLED:  # before the requests are made: they carry the batch's context
            traces.batch_started(model, batch, held, started)
        # First, so that the child computes while the loop does the rest.
        decoded, ahead = self._ahead(model, held)
        try:
            self.placement.touch(model)
            for lora in {p.handle.annotations.lora for p in batch.members} - {None}:
                self.placement.touch(lora_key(model, lora))
            for pending in batch.members:
                mark_started(self.replier, model, pending.handle, started)
            tokens = batch_tokens(batch.members, limits.padded)
            metrics.BATCH_REQUESTS.labels(model).observe(len(batch.members))
            metrics.BATCH_ITEMS.labels(model).observe(batch.shape.items)
            metrics.BATCH_TOKENS.labels(model).observe(tokens)
            metrics.BATCH_FILL.labels(model).observe(min(1.0, tokens / limits.max_tokens))
            future = self.executor.submit(self._run, model, held, generation, decoded, ahead)
        except BaseException:  # (shut down, say) the batch will not run, nor read its reply
            if ahead is not None:
                ahead.discard()
            raise
        self.futures[future] = batch
        future.add_done_callback(
            lambda f: self.loop.call_soon(self.done, generation, f)
        )

    def _ahead(self, model: str, batch: list[Held]
               ) -> tuple[tuple[list[Request], dict[str, Outcome], float] | None,
                          SentAhead | None]:
        """A lone small batch decoded on the loop and its frame sent to the runtime process
        now (`ProcessRuntime.send_ahead`, which never waits): (its requests, refusals and
        start time), and the runtime's handle of the frame sent, or None. Anything else
        (None, None) is decoded on the runtime's thread, as is every batch of a runtime
        that sends nothing ahead."""
        if not self.send_ahead or self.futures or any(h.blobs is not None for h in batch) \
                or sum(len(h.body) for h in batch) > AHEAD_BODY_BYTES:
            return None, None
        started = time.perf_counter()
        requests, refused = decode_requests(batch)
        ahead = self.runtime.send_ahead(model, requests) if requests else None
        return (requests, refused, started), ahead

    def _run(self, model: str, batch: list[Held], generation: int,
             decoded: tuple[list[Request], dict[str, Outcome], float] | None = None,
             ahead: SentAhead | None = None) -> tuple[list[Outcome], float | None]:
        """The batch (runtime thread): its outcomes in order, and how long it took if any
        of it ran. `decoded`, `ahead`: what the loop did of it already (`_ahead`)."""
        if decoded is None:
            started = time.perf_counter()
            requests, outcomes = decode_requests(batch)
        else:
            requests, outcomes, started = decoded
        if ahead is not None:  # first: nothing else may read its connection until it is
            outcomes.update((o.id, o) for o in self.runtime.run_batch(
                model, requests, ahead=ahead))  # (no stream: those are not sent ahead)
        elif requests:
            on_deltas = self.streams.queuer(generation, batch) \
                if any(r.stream for r in requests) else None
            outcomes.update((o.id, o) for o in self.runtime.run_batch(model, requests, on_deltas))
        answered = [outcomes[held.task_id] for held in batch]
        # A batch none of which ran (revoked, refused while the runtime restarts, failed)
        # says nothing of how long one takes: its time is not taught to the cost model.
        ran = any(o.ok for o in answered)
        return answered, time.perf_counter() - started if ran else None

    def finish(self, future: Future) -> tuple[str, list[Held], list[Outcome]] | None:
        """A batch ended (loop): the scheduler learns its time; its model, requests and
        outcomes (an error each if the runtime itself broke). None: not a batch of ours."""
        started = self.futures.pop(future, None)
        if started is None:
            return None
        outcomes: list[Outcome] | None = None
        seconds: float | None = None
        failure: Exception | None = None
        try:
            outcomes, seconds = future.result()
        except Exception as exc:  # the runtime itself broke; every request gets an error
            failure = exc
        if outcomes is not None and seconds is not None:
            # Requests dropped before the device (revoked, too late) did not run: the cost
            # model learns the time of what did.
            kept = [p for p, o in zip(started.members, outcomes, strict=True)
                    if o.error_code not in DROPPED_BEFORE_DEVICE]
            if len(kept) < len(started.members):
                started.shape = BatchShape.of(kept)
        batch = self.scheduler.finish(time.monotonic(), seconds, started)
        assert batch is started
        if tracing.ENABLED:
            traces.batch_ended(batch, outcomes)
        model, held = batch.lane.model, [p.handle for p in batch.members]
        if outcomes is None:
            log.exception("batch of %d failed", len(held), exc_info=failure)
            return model, held, [Outcome(h.task_id, error_code=ErrorCode.INTERNAL,
                                         error_message=f"runtime failed: {failure!r}")
                                 for h in held]
        if seconds is not None:
            metrics.BATCH_SECONDS.labels(model).observe(seconds)
        busy_ms = batch_device_ms(o.result for o in outcomes)
        if busy_ms is not None:
            metrics.DEVICE_BUSY.labels(model).inc(busy_ms / 1000)
            self.device_busy_s += busy_ms / 1000
        # The fleet's demand: how long this model's batches keep a device busy.
        self.placement.ran(model, busy_ms / 1000 if busy_ms is not None else seconds or 0.0)
        return model, held, outcomes

    def shutdown(self, wait: bool) -> None:
        """Stop the executor: without waiting, batches not started are cancelled."""
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
