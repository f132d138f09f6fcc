"""The worker's loop: the one owner of what happens to a request on this worker, and when.

Everything here runs on the Celery consumer's event loop thread (kombu channels are not
thread-safe) except the batch itself, which runs on the runtime's own thread. Its events:

- a message -> `Intake` decides what each of its requests becomes (`decisions`: placed
  where `Entries` says, its claims fetched first, refused, failed) -> applied here: in its
  model's scheduler lane, the continuous feeder, or parked for its LoRA adapter; loads
  start;
- tick -> the scheduler's `Actions` applied: refusals, `Batches.start`, prefetch, returns;
  the continuous `Feed` fed;
- a batch done, a continuous request done, a load done, a claim fetched (each handed back
  from another thread through the loop handle, `app.worker.lifecycle.loop`) -> the next
  parts of split requests, the next batch (started before this one's answers are
  published), its streams, its answers (`Answers`), the drain check.

Every decision is a collaborator's (the scheduler's, the feeder's, `Intake`'s, ...), which
returns it; this class applies it. The collaborators take what they need at construction
and never see this one; the only callbacks they hold are the other threads' events above.
What this class keeps is what the step needs between events: the connection's generation
(bumped on its loss: an answer of an older one is dropped), the tick's timer, and
`on_placement` (the pool-state step's; the shutdown step sets the drain's `on_drained`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.lifecycle.answers import Answers, refusal_message
from app.worker.lifecycle.batches import Batches
from app.worker.lifecycle.claims import ClaimFetcher, Fetched
from app.worker.lifecycle.consumers import Consumers
from app.worker.lifecycle.decisions import (
    Decision,
    Fail,
    Fetch,
    GiveBack,
    LoopSettings,
    Place,
    Refuse,
    Reject,
    Submit,
)
from app.worker.lifecycle.drain import Drain
from app.worker.lifecycle.entries import Entries
from app.worker.lifecycle.feed import Feed
from app.worker.lifecycle.fleet import FleetRow
from app.worker.lifecycle.generations import Generations
from app.worker.lifecycle.held import Held, Holdings
from app.worker.lifecycle.intake import Intake
from app.worker.lifecycle.loop import Loop
from app.worker.lifecycle.placement import Placed, Placement
from app.worker.lifecycle.replies import Delivery, Replier
from app.worker.lifecycle.returns import Returns
from app.worker.lifecycle.revokes import Revokes
from app.worker.lifecycle.splits import next_parts
from app.worker.lifecycle.streams import Streams
from app.worker.lifecycle.ticks import TIMER_SLACK_S, Ticks
from batching.feeder import Feeder, Waiting
from batching.hold import HoldLimits
from batching.lanes import Actions, Lane
from batching.pool import Pool
from batching.scheduler import Scheduler
from batching.shapes import Pending
from runtimes.base import Runtime
from tasks.envelope import EstimatingEntry, now_ms
from tasks.errors import ErrorCode
from tasks.pool_state import RESIDENT

log = logging.getLogger(__name__)

PARKED_TOO_LONG = "the request's deadline passed while its LoRA adapter was loading"


class Dispatcher:
    """The worker's loop and what it keeps between events (see the module)."""

    def __init__(self, loop: Loop, runtime: Runtime, lanes: dict[str, Lane],
                 hold: HoldLimits, *, entries: dict[str, EstimatingEntry],
                 settings: LoopSettings | None = None, pool: Pool | None = None,
                 pinned: set[str] | None = None,
                 load_s: dict[str, float] | None = None) -> None:
        settings = settings or LoopSettings()
        self.runtime = runtime
        # What the runtime can do, read once: batches at once (pipelined: each waits for
        # its answer on a thread here), side by side (replicas).
        capabilities = runtime.capabilities
        depth = max(1, capabilities.pipeline_depth)
        self.scheduler = Scheduler(lanes, hold, lambda model, now: self.consumers.peers(model, now),
                                   depth=depth, parallel=max(1, capabilities.parallel))
        self.continuous = {model for model in lanes if runtime.continuous(model)}
        self.feeder = Feeder(settings.feed_return_after_s, hold.delivery_limit)
        # Every request held here, in its state (`app.worker.lifecycle.held`).
        self.holdings = Holdings(self.scheduler, self.feeder)
        self.replier = Replier(loop)
        self.claims = ClaimFetcher(settings.blob_url, settings.claim_upload_timeout_s,
                                   loop.call_soon)
        self.streams = Streams(runtime, self.replier, loop, lambda: self.generation)
        self.ticks = Ticks(loop, self.tick)
        self.generation = 0  # bumped on connection loss: old messages cannot be acked
        self.on_placement: Callable[[], None] = lambda: None  # a model's state changed
        self.placement = Placement(
            runtime, pool or Pool(2**62), list(lanes), pinned or set(),
            loop.call_soon, self.holdings.in_use, self._on_placed, load_s or {})
        self.placement.running = lambda: {b.lane.model for b in self.scheduler.in_flight}
        self.consumers = Consumers(self.scheduler, self.placement, settings.prefetch)
        self.fleet = FleetRow(self.placement, self.consumers)  # the pool-state step's timer
        self.returns = Returns(self.consumers, self.replier, loop)
        self.batches = Batches(runtime, self.scheduler, self.placement, self.streams,
                               self.replier, loop, depth, self._on_batch_done)
        # Draining for a shutdown (`app.worker.steps.drain`, through `WorkerView`).
        self.drain = Drain(lanes, hold.delivery_limit, lambda: (
            self.batches.idle and self.holdings.empty and self.replier.unconfirmed == 0))
        self.replier.on_confirmed = self.drain.check
        self.answers = Answers(self.replier, loop, self.drain)
        self.revokes = Revokes(self.holdings)
        self.feed = Feed(self.feeder, self.continuous,
                         lambda model: self.placement.state(model) == RESIDENT,
                         runtime.load_of, self.consumers.peers)
        self.generations = Generations(runtime, self.holdings, self.placement, self.streams,
                                       self.replier, loop, self._on_request_done)
        # Where a request waits (pure); `Intake` decides with it what each message becomes.
        self.entries = Entries(self.scheduler.lanes, entries, self.continuous,
                               settings.part_target_s, settings.lora_mixed_batches)
        self.intake = Intake(self.entries, self.replier, self.claims)
        for model, lane in lanes.items():
            lane.ready = self.placement.state(model) == RESIDENT

    # --- the event: a message in ------------------------------------------------------------

    def on_message(self, message: Any) -> None:
        """A delivered message: what `Intake` decides of its requests applied, a tick queued."""
        if self.drain.active:
            self.drain.refuse(message)  # delivered before the broker saw the cancel
            return
        try:
            tick = False
            for decision in self.intake.take(message):
                if type(decision) is Place:  # nearly every request: one call less
                    self._place(*decision)
                    tick = True
                else:
                    tick = self._decided(decision) or tick
            if tick:
                self.ticks.queue()
        except Exception:
            # Whatever a message holds, it must not take the consumer down.
            log.exception("message dead-lettered: it could not be held")
            message.reject(requeue=False)

    def _decided(self, decision: Decision) -> bool:
        """Apply a request's decision (`Intake`'s, `Entries`', the `Feed`'s); whether to tick."""
        if type(decision) is Place:
            self._place(*decision)
        elif type(decision) is Refuse:
            self.refuse(*decision)
        elif type(decision) is Fetch:
            self._fetch(*decision)
        elif type(decision) is Fail:
            self.replier.failure(*decision)
            return False
        elif type(decision) is Reject:
            decision.message.reject(requeue=False)
            return False
        elif type(decision) is Submit:
            if (refused := self.generations.submit(*decision, self.generation)) is not None:
                self.holdings.settle(decision.held)
                self.answers.answer(decision.model, decision.held, refused)
        elif type(decision) is GiveBack:
            self.give_back(*decision)
            metrics.RETURNS.labels(decision.model).inc(len(decision.held))
        return True

    def _place(self, model: str, held: Held, deliveries: int, entry: Pending | Waiting
               ) -> None:
        """Into its feeder or lane, or parked for its LoRA adapter; its loads start."""
        # Asked for = used: a popular model stays recent while its requests wait.
        self.placement.touch(model)
        if isinstance(entry, Waiting):  # a continuously batching runtime's
            self.holdings.wait(model, entry)
            if self.placement.state(model) != RESIDENT:
                self._ensure(model)
            return
        lora = held.annotations.lora
        if lora is not None and not self.placement.lora_resident(model, lora):
            self.holdings.park(model, lora, held, deliveries)
            why = self.placement.ensure(model, lora)
            if why is not None:
                self._on_lora(model, lora, why)
            return
        self.holdings.schedule(model, entry)
        if not self.scheduler.lanes[model].ready:
            self._ensure(model)

    def _fetch(self, model: str, held: Held, deliveries: int) -> None:
        """Its claimed inputs fetched (fetcher's threads) first: placed in `_on_fetched`."""
        generation = self.generation
        a = held.annotations
        self.holdings.fetch(model, held)
        self.claims.fetch(held.body, a.sent_ms, a.deadline_ms,
                          lambda: held.task_id in worker_state.revoked,
                          lambda fetched: self._on_fetched(generation, model, held,
                                                           deliveries, fetched))

    def _ensure(self, model: str) -> None:
        """Have `model` loaded; if it cannot be, what is held for it is answered."""
        why = self.placement.ensure(model)
        if why is not None:
            self._on_load_failed(model, why)

    # --- applied wherever decided: each settles what it answers or gives back --------------

    def refuse(self, model: str, held: Held, why: str,
               code: ErrorCode = ErrorCode.DEADLINE_EXCEEDED) -> None:
        self.holdings.settle(held)
        self.answers.refuse(model, held, why, code)

    def give_back(self, model: str, held: list[Held],
                  renew: Callable[[Delivery], bool] | None = None) -> None:
        self.holdings.settle_all(held)
        self.returns.give_back(model, held, renew)

    # --- the event: tick ---------------------------------------------------------------

    def tick(self) -> None:
        """The scheduler's decisions applied (the feed's, the parked deadlines' too)."""
        self.ticks.ticking()
        actions = self.scheduler.tick(time.monotonic())
        with self.drain:  # its refusals are answers too: a drain ends after them all
            for wake in (self._expire_parked() if self.holdings.parked else None,
                         self._feed() if self.continuous else None):
                if wake is not None:
                    actions.wake_in = wake if actions.wake_in is None \
                        else min(actions.wake_in, wake)
            self._apply(actions)

    def _expire_parked(self) -> float | None:
        """Refuse the parked requests whose deadline passed; seconds to the next, or None."""
        now = now_ms()
        expired, soonest = self.holdings.expire_parked(now)
        for model, held in expired:
            self.answers.refuse(model, held, PARKED_TOO_LONG)
        return None if soonest is None else max((soonest - now) / 1000, TIMER_SLACK_S)

    def _feed(self) -> float | None:
        """The continuous feed's decisions applied; seconds until it must run again."""
        decisions, wake = self.feed.feed(time.monotonic())
        for decision in decisions:
            self._decided(decision)
        return wake

    def _apply(self, actions: Actions) -> None:
        for model, pending in actions.expired:
            self.refuse(model, pending.handle,
                         "the request's deadline passed before a worker could run it")
        for model, late in actions.late:
            self.refuse(model, late.pending.handle, refusal_message(late),
                         ErrorCode.DEADLINE_TOO_SHORT if late.too_short
                         else ErrorCode.DEADLINE_EXCEEDED)
        if actions.start is not None:
            self.holdings.run(actions.start)
            self.batches.start(actions.start, self.generation)
        for model, prefetch in actions.prefetch.items():
            self.consumers.set_prefetch(model, prefetch)
        for model, returned in actions.returned:
            self.give_back(model, [pending.handle for pending in returned])
            metrics.RETURNS.labels(model).inc(len(returned))
            log.info("returned %d requests of %s to the queue", len(returned), model)
        for lane in self.scheduler.lanes.values():
            metrics.HELD.labels(lane.model).set(len(lane.backlog))
        self.ticks.wake_in(actions.wake_in)

    # --- the events other threads hand back: a batch, a request, a fetch, a load done ------

    def _on_batch_done(self, generation: int, future: Future) -> None:
        """A batch ended: the next parts, the next batch, its answers, the drain check."""
        # Until its answers are all published, the drain is not over, whatever is seen
        # meanwhile (confirms of the first answers read while the rest go out, a tick).
        with self.drain:
            done = self.batches.finish(future)
            if done is None:
                return
            model, held, outcomes = done
            self.holdings.settle_all(held)
            # Each split request's next part joins the backlog, behind what arrived
            # meanwhile. Parts are never returned, so their delivery count does not matter.
            for part in next_parts(held, outcomes):
                self.holdings.schedule(model, self.entries.pending(part, 1))
            self.placement.kick()  # a queued load may fit now that this batch is done
            # Start the next batch before answering this one: the runtime computes
            # while the loop publishes results, instead of idling until they are out.
            self.tick()
            self.streams.publish()  # a stream's last deltas go before its result
            if generation == self.generation:
                self.answers.answer_batch(model, held, outcomes)
            # else: the connection was lost meanwhile; the messages are redelivered.

    def _on_request_done(self, generation: int, model: str, held: Held,
                         future: Future) -> None:
        """A continuous runtime ended a request: its answer, the next handed over."""
        with self.drain:
            self.streams.publish()  # its last deltas go before its result
            outcome = self.generations.finish(model, held, future)
            self.holdings.settle(held)
            if generation == self.generation:
                self.answers.answer(model, held, outcome)
            self.ticks.queue()  # a slot is free: hand over the next

    def _on_fetched(self, generation: int, model: str, held: Held, deliveries: int,
                    outcome: Fetched) -> None:
        """A request's claimed inputs came (or could not be had): it is placed."""
        if generation != self.generation:
            return  # the connection was lost: the message is redelivered
        if not self.holdings.fetched(held):
            return  # handed back when the drain began
        if outcome.error_code is not None:
            self.refuse(model, held, outcome.error_message or "",
                         ErrorCode(outcome.error_code))
            return
        held.blobs = outcome.blobs
        self._decided(self.entries.place(model, held, deliveries))
        self.ticks.queue()

    def _on_placed(self, event: Placed) -> None:
        """A model's state changed here, or a LoRA adapter's load ended (`Placed`)."""
        model, state, lora, why = event
        if lora is not None:
            self._on_lora(model, lora, why)
            return
        lane = self.scheduler.lanes[model]
        lane.ready = state == RESIDENT
        if lane.ready:
            now = time.monotonic()
            for pending in lane.backlog:
                metrics.LOAD_WAIT.labels(model).observe(now - pending.received)
        self.consumers.follow_state(model, state)
        self.on_placement()
        self.ticks.queue()
        if why is not None:
            self._on_load_failed(model, why)
        elif lane.ready:
            for parked in self.holdings.parked_loras(model):
                if failed := self.placement.ensure(model, parked):
                    self._on_lora(model, parked, failed)

    def _on_load_failed(self, model: str, why: str) -> None:
        for pending in self.scheduler.drop(model):
            self.refuse(model, pending.handle, why, ErrorCode.MODEL_UNAVAILABLE)
        for waiting in self.feeder.drop(model):
            self.refuse(model, waiting.handle, why, ErrorCode.MODEL_UNAVAILABLE)
        metrics.HELD.labels(model).set(0)
        for lora in self.holdings.parked_loras(model):
            self._on_lora(model, lora, why)

    def _on_lora(self, model: str, lora: str, why: str | None) -> None:
        """A LoRA adapter's load ended (why None: loaded): its parked requests go on."""
        for held, deliveries in self.holdings.unpark(model, lora):
            if why is None:
                self.holdings.schedule(model, self.entries.pending(held, deliveries))
            else:
                self.refuse(model, held, why, ErrorCode.MODEL_UNAVAILABLE)
        self.on_placement()
        self.ticks.queue()

    # --- what the worker's steps and remote control ask (through `WorkerView`) -------------

    def drop_held(self) -> None:
        """Forget held messages after a connection loss (the broker redelivers them)."""
        self.generation += 1
        self.holdings.clear()
        for model in self.scheduler.lanes:
            metrics.HELD.labels(model).set(0)
        self.consumers.clear()
        self.ticks.cancel()
