"""The worker's loop: the one owner of what happens to a request on this worker, and when.

Everything here runs on the Celery consumer's event loop thread (kombu channels are not
thread-safe) except the batch itself, which runs on the runtime's own thread. Its step:

- a message → `Intake` holds its requests → each is placed (`_place`): in its model's
  scheduler lane, the continuous feeder, or parked for its LoRA adapter; loads start;
- tick → the scheduler's `Actions` applied: refusals, `Batches.start`, prefetch, returns;
  the continuous `Feed` fed;
- a batch done → the next parts of split requests, the next batch (started before this
  one's answers are published), its streams, its answers (`Answers`), the drain check.

Every decision is `batching.scheduler.Scheduler`'s (or, for a continuously batching
runtime, `batching.feeder`'s); this class feeds them events and hands what they decide to
its collaborators, each a class of its own that takes what it needs at construction and
never sees this one: `Intake` (a message becomes held requests, and what each becomes where
it waits), `Batches` (the runtime's thread, the batches in flight, their outcomes), `Feed`
(the continuous runtime), `Drain` (a shutdown's drain, its state in one object), `Answers`,
`Returns` (given back to the queue), `Revokes` (released at once), `Streams`, `Holdings`
(every request held, by state), `Consumers` (prefetch, priority, peers), `Placement` (loads
beside the batches), the `Replier` and the claims' fetcher. They report back through the
callbacks they were given (`Intake` hands over each request, `Batches` and `Feed` what
ended, `Placement` a load's end), so a request's life reads here from its delivery to its
answer. What this class keeps is what the step needs between events: the connection's
generation (bumped on its loss: an answer of an older one is dropped), the tick's timer,
and `on_placement` (the pool-state step's; the shutdown step sets the drain's
`on_drained`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from app.worker import metrics
from app.worker.lifecycle.answers import Answers, refusal_message
from app.worker.lifecycle.batches import Batches
from app.worker.lifecycle.claims import ClaimFetcher
from app.worker.lifecycle.consumers import Consumers
from app.worker.lifecycle.drain import Drain
from app.worker.lifecycle.feed import Feed
from app.worker.lifecycle.fleet import FleetRow
from app.worker.lifecycle.held import Held, Holdings
from app.worker.lifecycle.intake import Intake
from app.worker.lifecycle.placement import Placement
from app.worker.lifecycle.replies import Replier
from app.worker.lifecycle.returns import Returns
from app.worker.lifecycle.revokes import Revokes
from app.worker.lifecycle.splits import next_parts
from app.worker.lifecycle.streams import Streams
from batching.feeder import Feeder
from batching.hold import HoldLimits
from batching.lanes import Actions, Lane
from batching.pool import Pool
from batching.scheduler import Scheduler
from runtimes.base import Runtime
from tasks.envelope import EstimatingEntry, now_ms
from tasks.errors import ErrorCode
from tasks.pool_state import RESIDENT

log = logging.getLogger(__name__)

# A wake-up this close to the one already set needs no new timer.
TIMER_SLACK_S = 0.001


class Dispatcher:
    """The worker's loop and what it keeps between events (see the module)."""

    def __init__(self, consumer: Any, runtime: Runtime, lanes: dict[str, Lane],
                 hold: HoldLimits, entries: dict[str, EstimatingEntry],
                 part_target_s: float | None = None, pool: Pool | None = None,
                 pinned: set[str] | None = None, prefetch: int = 64,
                 load_s: dict[str, float] | None = None,
                 lora_mixed_batches: bool = True, feed_return_after_s: float = 0.2,
                 blob_url: str = "", claim_upload_timeout_s: float = 10.0) -> None:
        self.c = consumer
        self.runtime = runtime
        # A pipelined runtime takes the next batch while it computes one (its
        # `pipeline_depth`); each batch in flight waits for its answer on a thread here.
        depth = max(1, runtime.pipeline_depth)
        # Runtime replicas run that many of them side by side (`runtimes.worker_side.replicas`).
        parallel = max(1, runtime.parallel)
        self.scheduler = Scheduler(lanes, hold, lambda model, now: self.consumers.peers(model, now),
                                   depth=depth, parallel=parallel)
        self.continuous = {model for model in lanes if runtime.continuous(model)}
        self.feeder = Feeder(feed_return_after_s, hold.delivery_limit)
        # Every request held here, in whichever state (scheduled, parked for a LoRA,
        # fetching its claims, waiting for or handed to a continuous runtime).
        self.holdings = Holdings(self.scheduler, self.feeder)
        self.replier = Replier(consumer)
        self.claims = ClaimFetcher(blob_url, claim_upload_timeout_s,
                                   lambda fn: self.c.hub.call_soon(fn))
        self.streams = Streams(runtime, self.replier, consumer, lambda: self.generation)
        self._timer: Any = None
        self._timer_at = 0.0
        self._tick_queued = False
        self.generation = 0  # bumped on connection loss: old messages cannot be acked
        self.on_placement: Callable[[], None] = lambda: None  # a model's state changed
        self.placement = Placement(
            runtime, pool or Pool(2**62), list(lanes), pinned or set(),
            lambda fn, *args: self.c.hub.call_soon(fn, *args), self.holdings.in_use,
            self._on_state, self._on_load_failed, load_s or {}, self._on_lora)
        self.placement.running = lambda: {b.lane.model for b in self.scheduler.in_flight}
        self.consumers = Consumers(self.scheduler, self.placement, prefetch)
        self.fleet = FleetRow(self.placement, self.consumers)  # the pool-state step's timer
        self.returns = Returns(self.consumers, self.replier, consumer)
        self.batches = Batches(runtime, self.scheduler, self.placement, self.streams,
                               self.replier, consumer, depth, self._on_batch_done)
        # Draining for a shutdown (`begin`, `check`, `on_drained`: `app.worker.steps.drain`).
        self.drain = Drain(self.scheduler, self.holdings, self.consumers, self.returns,
                           self.batches, self.replier, hold.delivery_limit)
        self.replier.on_confirmed = self.drain.check
        self.answers = Answers(self.replier, consumer, self.drain)
        self.revokes = Revokes(self.holdings, self.answers, runtime, self._queue_tick)
        self.feed = Feed(runtime, self.feeder, self.continuous, self.placement, self.consumers,
                         self.answers, self.returns, self.streams, self.replier, consumer,
                         self._on_request_done)
        self.intake = Intake(self.scheduler.lanes, entries, self.replier, self.answers,
                             self.holdings, self.claims, self._place, self._queue_tick,
                             lambda: self.generation, part_target_s, lora_mixed_batches)
        for model, lane in lanes.items():
            lane.ready = self.placement.state(model) == RESIDENT

    # --- the step: a message in -------------------------------------------------------------

    def on_message(self, message: Any) -> None:
        """A delivered message: its requests held and placed, a tick queued."""
        if self.drain.active:
            self.drain.refuse(message)  # delivered before the broker saw the cancel
            return
        try:
            if self.intake.take(message):
                self._queue_tick()
        except Exception:
            # Whatever a message holds, it must not take the consumer down.
            log.exception("message dead-lettered: it could not be held")
            message.reject(requeue=False)

    def _place(self, model: str, held: Held, deliveries: int) -> None:
        """A held request, its inputs at hand, joins its model's feeder or scheduler, or is
        parked until its LoRA adapter is loaded; what it needs starts loading."""
        # Asked for = used: a popular model stays recent while its requests wait.
        self.placement.touch(model)
        if model in self.continuous:
            self.feeder.add(model, self.intake.waiting(held, deliveries))
            if self.placement.state(model) != RESIDENT:
                self._ensure(model)
            return
        if (held := self.intake.first_part(model, held)) is None:
            return  # refused: it cannot finish within its whole deadline
        lora = held.annotations.lora
        if lora is not None and not self.placement.lora_resident(model, lora):
            self.holdings.park(model, lora, held, deliveries)
            why = self.placement.ensure(model, lora)
            if why is not None:
                self._on_lora(model, lora, why)
            return
        self.scheduler.append(model, self.intake.pending(held, deliveries))
        if not self.scheduler.lanes[model].ready:
            self._ensure(model)

    def _ensure(self, model: str) -> None:
        """Have `model` loaded; if it cannot be, what is held for it is answered."""
        why = self.placement.ensure(model)
        if why is not None:
            self._on_load_failed(model, why)

    # --- the step: tick -----------------------------------------------------------------

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

    def tick(self) -> None:
        """The scheduler's decisions (and the feed's, the parked requests' deadlines)
        applied."""
        self._tick_queued = False
        actions = self.scheduler.tick(time.monotonic())
        for wake in (self._expire_parked() if self.holdings.parked else None,
                     self.feed.feed(self.generation) if self.continuous else None):
            if wake is not None:
                actions.wake_in = wake if actions.wake_in is None else min(actions.wake_in, wake)
        if not self.drain.active:
            self._apply(actions)
            return
        # Its refusals (deadlines passed) are answers too: the drain ends after them all.
        answering = self.drain.answering
        self.drain.answering = answering + 1
        try:
            self._apply(actions)
        finally:
            self.drain.answering = answering
        if not answering:
            self.drain.check()

    def _expire_parked(self) -> float | None:
        """Answer the parked requests whose deadline passed (they wait for a LoRA outside
        the scheduler); seconds until the next such deadline, or None."""
        now = now_ms()
        expired, soonest = self.holdings.expire_parked(now)
        for model, held in expired:
            self.answers.refuse(model, held, "the request's deadline passed while its LoRA "
                                "adapter was loading")
        return None if soonest is None else max((soonest - now) / 1000, TIMER_SLACK_S)

    def _apply(self, actions: Actions) -> None:
        for model, pending in actions.expired:
            self.answers.refuse(model, pending.handle,
                                "the request's deadline passed before a worker could run it")
        for model, late in actions.late:
            self.answers.refuse(model, late.pending.handle, refusal_message(late),
                                ErrorCode.DEADLINE_TOO_SHORT if late.too_short
                                else ErrorCode.DEADLINE_EXCEEDED)
        if actions.start is not None:
            self.batches.start(actions.start, self.generation)
        for model, prefetch in actions.prefetch.items():
            self.consumers.set_prefetch(model, prefetch)
        for model, returned in actions.returned:
            self.returns.give_back(model, [pending.handle for pending in returned])
            metrics.RETURNS.labels(model).inc(len(returned))
            log.info("returned %d requests of %s to the queue", len(returned), model)
        for lane in self.scheduler.lanes.values():
            metrics.HELD.labels(lane.model).set(len(lane.backlog))
        self._wake_in(actions.wake_in)

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

    # --- the step: a batch done ---------------------------------------------------------

    def _on_batch_done(self, generation: int, future: Future) -> None:
        """A batch ended: the next parts, the next batch, its answers, the drain check."""
        # Until its answers are all published, the drain is not over, whatever is seen
        # meanwhile (confirms of the first answers read while the rest go out, a tick).
        self.drain.answering += 1
        try:
            done = self.batches.finish(future)
            if done is None:
                return
            model, held, outcomes = done
            # Each split request's next part joins the backlog, behind what arrived
            # meanwhile. Parts are never returned, so their delivery count does not matter.
            for part in next_parts(held, outcomes):
                self.scheduler.append(model, self.intake.pending(part, 1))
            self.placement.kick()  # a queued load may fit now that this batch is done
            # Start the next batch before answering this one: the runtime computes
            # while the loop publishes results, instead of idling until they are out.
            self.tick()
            self.streams.publish()  # a stream's last deltas go before its result
            if generation == self.generation:
                self.answers.answer_batch(model, held, outcomes)
            # else: the connection was lost meanwhile; the messages are redelivered.
        finally:
            self.drain.answering -= 1
        self.drain.check()

    def _on_request_done(self, generation: int, model: str, held: Held,
                         future: Future) -> None:
        """A continuous runtime ended a request: its answer, the next handed over."""
        self.streams.publish()  # its last deltas go before its result
        outcome = self.feed.finish(model, held, future)
        if generation == self.generation:
            self.drain.answering += 1
            try:
                self.answers.answer(model, held, outcome)
            finally:
                self.drain.answering -= 1
        self._queue_tick()  # a slot is free: hand over the next
        self.drain.check()

    # --- placement (loop thread) -----------------------------------------------------------

    def _on_state(self, model: str, state: str) -> None:
        """A model became resident, loading or cold here: its lane and its consumer follow."""
        lane = self.scheduler.lanes[model]
        lane.ready = state == RESIDENT
        if lane.ready:
            now = time.monotonic()
            for pending in lane.backlog:
                metrics.LOAD_WAIT.labels(model).observe(now - pending.received)
        self.consumers.follow_state(model, state)
        self.on_placement()
        self._queue_tick()
        if lane.ready:
            for lora in self.holdings.parked_loras(model):
                if why := self.placement.ensure(model, lora):
                    self._on_lora(model, lora, why)

    def _on_load_failed(self, model: str, why: str) -> None:
        for pending in self.scheduler.drop(model):
            self.answers.refuse(model, pending.handle, why, ErrorCode.MODEL_UNAVAILABLE)
        for waiting in self.feeder.drop(model):
            self.answers.refuse(model, waiting.handle, why, ErrorCode.MODEL_UNAVAILABLE)
        metrics.HELD.labels(model).set(0)
        for lora in self.holdings.parked_loras(model):
            self._on_lora(model, lora, why)

    def _on_lora(self, model: str, lora: str, why: str | None) -> None:
        """A LoRA adapter's load ended (why None: loaded): its parked requests go on."""
        for held, deliveries in self.holdings.unpark(model, lora):
            if why is None:
                self.scheduler.append(model, self.intake.pending(held, deliveries))
            else:
                self.answers.refuse(model, held, why, ErrorCode.MODEL_UNAVAILABLE)
        self.on_placement()
        self._queue_tick()

    # --- what the worker's steps and its remote control call ------------------------

    def cancel(self, task_ids: list[str]) -> list[str]:
        """Revoke requests (loop thread): released at once wherever they are (`Revokes`).
        The ids that were running here."""
        return self.revokes.revoke(task_ids)

    def abandon(self) -> int:
        """A forced end: publish and ack nothing more (the broker redelivers it); the
        number of requests that were running."""
        unfinished = self.holdings.unfinished
        self.drain.abandon()
        self.drop_held()
        return unfinished

    def drop_held(self) -> None:
        """Forget held messages after a connection loss (the broker redelivers them)."""
        self.generation += 1
        self.holdings.clear()
        for model in self.scheduler.lanes:
            metrics.HELD.labels(model).set(0)
        self.consumers.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def close(self) -> None:
        self.claims.close()
        self.placement.close()
        # The runtime first: a batch still running (a forced or cold shutdown; a drained
        # worker runs none) fails at once instead of holding the exit up.
        self.batches.shutdown(wait=False)
        self.runtime.close()
        self.batches.shutdown(wait=True)
