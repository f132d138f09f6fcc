"""The worker's scheduler: one owner of all batching state, driven by commands.

The dispatcher (app/worker/lifecycle/dispatcher.py) feeds it what happened and applies what it
decides; it does no I/O and reads no clock, so every rule below is testable
with plain data and a fake `now` (seconds, one monotonic clock throughout):

- `append(model, pending, now)`: a message was delivered and is now held;
- `tick(now)`: look at everything held and decide; returns an `Actions`
  (answer these as expired or late, give these back, change these prefetch
  counts, start this batch, call me again in so many seconds);
- `finish(now, seconds, batch)`: a running batch ended (`seconds`: its measured
  time, or None if the runtime broke);
- `clear()`: the connection was lost, the broker redelivers everything held;
- `release(model, keys)`: these requests were revoked: out of the backlog at once.

The rules, each owned by a pure function of `batching/`:
- up to `depth` batches in flight to the runtime (one by default; a pipelined
  runtime takes a second while it computes the first, and answers them in order);
  one behind another starts when at least half full, or when the ones ahead are due
  to end soon (`PIPELINE_LEAD`): small batches back to back would each pay the fixed
  cost of a batch;
  the lane whose oldest held request has waited longest goes next; `take_batch`
  forms the batch: requests callers wait for before a bulk job's parts, which get a
  batch at least every `bulk_pass_s` while passed over (`Lane.took` keeps that clock);
- an idle runtime starts at once; under load it may wait up to the profile's
  `max_delay_s` for a fuller batch (`seconds_to_wait`);
- a request whose deadline has passed is answered DEADLINE_EXCEEDED; so is a
  request whose batch is predicted to finish after its deadline: running it
  would spend the device on an answer nobody waits for;
- what each lane's consumer may take in (its prefetch) and what goes back to the
  queue: `batching.credit`.

Lanes, batches and the actions it returns are plain data (`batching.lanes`).
"""

from __future__ import annotations

import math
from collections.abc import Container, Hashable
from dataclasses import replace

from batching.credit import ConsumerCredit
from batching.former import is_full, leader, seconds_to_wait, split_expired, take_batch
from batching.hold import HoldLimits
from batching.lanes import MIN_WAIT_S, Actions, Batch, Lane, Late, PeerCount
from batching.latency_model import Admission
from batching.shapes import BatchShape, Pending

# A batch overrunning its prediction is looked at again (for returns) after this much
# of its prediction, then every prediction (at least every OVERRUN_MIN_S).
OVERRUN_FIRST = 1.5
OVERRUN_MIN_S = 0.05
OVERRUN_REPEAT_MIN_S = 0.25
# A batch that would join others in flight while under half full starts once they are
# due to end within this share of its own predicted time.
PIPELINE_LEAD = 0.5


class Scheduler:
    """The worker's batching state and the rules that start batches (module docstring);
    the intake side of a tick is its `ConsumerCredit`'s."""

    def __init__(self, lanes: dict[str, Lane], hold: HoldLimits, peers: PeerCount,
                 depth: int = 1, parallel: int = 1) -> None:
        self.lanes = lanes
        self.hold = hold
        self.peers = peers
        self.depth = depth  # batches in flight to the runtime at most
        # Batches the runtime runs side by side (its replicas, `runtimes.worker_side.replicas`):
        # while
        # fewer are in flight, a new batch waits behind none of them.
        self.parallel = max(1, min(parallel, depth))
        self.in_flight: list[Batch] = []  # in the order they started (and end)
        self.last_finished: float | None = None
        self._adapt: Lane | None = None  # the lane whose batch just ended
        self._credit = ConsumerCredit(lanes, hold, peers)
        # What each lane's current consumer delivered (the credit's record): `append`, run
        # per request, adds to it directly.
        self._drawn = self._credit.drawn

    # --- commands ------------------------------------------------------------------------

    def append(self, model: str, pending: Pending) -> None:
        lane = self.lanes[model]
        lane.backlog.append(pending)
        if not pending.bulk:
            lane.waited_for_at = pending.received
        lane.mix.add(pending)
        # A part of a split request is never returned, and the parts after its first are
        # no deliveries: left out, the worker only believes its credit larger than it is.
        if pending.returnable:
            self._drawn[model].add(id(pending))

    @property
    def running(self) -> Batch | None:
        """The oldest batch in flight (the one the runtime works on first)."""
        return self.in_flight[0] if self.in_flight else None

    def finish(self, now: float, seconds: float | None, batch: Batch | None = None
               ) -> Batch | None:
        """A batch in flight ended (`batch`, default the oldest); learn its time. Returns it
        (None if none ran).

        With batches in flight behind one another, `seconds` (from its hand-over to its
        answer) counts the wait behind the one before: the time it added is since that
        one ended, if that was after it started."""
        if batch is None:
            batch = self.running
        if batch is None or batch not in self.in_flight:
            return None
        self.in_flight.remove(batch)
        if seconds is not None and self.depth > 1:
            seconds = min(seconds, now - batch.started)
        if len(self.in_flight) >= self.parallel and \
                self.in_flight[self.parallel - 1].started < now:
            # The next one waiting runs from now (with replicas, beside the others that
            # run): its time left and its overrun check count from here, not from when
            # it was handed over.
            head = self.in_flight[self.parallel - 1]
            head.started = now
            head.check_at = max(head.check_at,
                                now + max(head.predicted_s * OVERRUN_FIRST, OVERRUN_MIN_S))
        self.last_finished = now
        if seconds is not None:
            batch.lane.cost.observe(batch.shape, seconds)
        self._adapt = batch.lane
        # Acked once answered, after `tick`.
        self._credit.settled(batch.lane.model, batch.members)
        return batch

    def clear(self) -> None:
        """Forget every held request (the broker redelivers them). A running batch
        still finishes."""
        for lane in self.lanes.values():
            lane.backlog.clear()
        self._adapt = None
        self._credit.forget()

    def drop(self, model: str) -> list[Pending]:
        """Take every request held for `model` out (they are answered, e.g. its load
        failed)."""
        lane = self.lanes[model]
        dropped, lane.backlog[:] = list(lane.backlog), []
        self._credit.settled(model, dropped)
        return dropped

    def release(self, model: str, keys: Container[Hashable]) -> list[Pending]:
        """Take the requests with these keys out of `model`'s backlog (revoked: they are
        answered at once, unrun)."""
        lane = self.lanes[model]
        released = [p for p in lane.backlog if p.key in keys]
        if released:
            lane.backlog[:] = [p for p in lane.backlog if p.key not in keys]
            self._credit.settled(model, released)
        return released

    def in_use(self) -> set[str]:
        """The models with a batch running or requests held: none may be evicted."""
        used = {model for model, lane in self.lanes.items() if lane.backlog}
        used.update(batch.lane.model for batch in self.in_flight)
        return used

    def prefetch_applied(self, model: str, prefetch: int) -> None:
        """The dispatcher (re)started the consumer of `model` with this prefetch."""
        self._credit.applied(model, prefetch)

    def tick(self, now: float) -> Actions:
        actions = Actions()
        for lane in self.lanes.values():
            if lane.backlog:
                expired = split_expired(lane.backlog, now)
                if expired:
                    self._credit.settled(lane.model, expired)
                    actions.expired.extend((lane.model, p) for p in expired)
        wait = None
        if len(self.in_flight) < self.depth:
            wait = self._maybe_start(now, actions)
        if self._adapt is not None:
            if self.peers(self._adapt.model, now) < 2:  # with peers: `bound` below
                self._credit.after_batch(self._adapt, actions)
            self._adapt = None
        credit_in = self._credit.bound(now, self.busy_for(now), actions)
        if credit_in is not None:
            wait = credit_in if wait is None else min(wait, credit_in)
        expires_in = self._first_deadline_waiting_for_a_load(now)
        if expires_in is not None:
            wait = expires_in if wait is None else min(wait, expires_in)
        actions.wake_in = self._wake_in(now, wait)
        return actions

    # --- rules ---------------------------------------------------------------------------

    def _first_deadline_waiting_for_a_load(self, now: float) -> float | None:
        """Seconds until the first deadline of a request whose model is loading: it is
        answered then, not when the load ends."""
        deadlines = [p.deadline for lane in self.lanes.values() if not lane.ready
                     for p in lane.backlog if p.deadline is not None]
        return max(min(deadlines) - now, MIN_WAIT_S) if deadlines else None

    def next_lane(self) -> Lane | None:
        """The lane whose oldest held request has waited longest."""
        waiting = [lane for lane in self.lanes.values() if lane.backlog and lane.ready]
        return min(waiting, key=lambda lane: lane.backlog[0].received, default=None)

    def _maybe_start(self, now: float, actions: Actions) -> float | None:
        """Start a batch if one should start now; else the seconds to wait (None: nothing)."""
        while (lane := self.next_lane()) is not None:
            wait = seconds_to_wait(lane.backlog, lane.limits, now, self.last_finished)
            if wait >= MIN_WAIT_S:
                return wait
            ahead = self.busy_for(now)  # the batches in flight end first
            limits = lane.limits
            if lane.callers_active(now) and leader(lane.backlog, lane.bulk_turn(now)).bulk:
                # Job parts beside callers: one short batch at a time, so that the next
                # caller waits for one slice at most.
                if self.in_flight:
                    return max(ahead, MIN_WAIT_S)
                limits = replace(limits, latency_target_s=min(
                    limits.bulk_slice_s, limits.latency_target_s or math.inf))
            if len(self.in_flight) >= self.parallel and not is_full(lane.backlog,
                                                                     lane.limits):
                # Behind a batch in flight, a small batch now pays a batch's fixed cost
                # for a few requests, and the next ones would pay it again: it starts
                # once half a batch waits, or once the batches ahead are due to end
                # within half its own time (enough to prepare it while they run).
                lead = PIPELINE_LEAD * lane.cost.predict(BatchShape.of(lane.backlog))
                if ahead - lead >= MIN_WAIT_S:
                    return ahead - lead
            members = take_batch(lane.backlog, limits, lane.cost, now, lane.bulk_turn(now))
            lane.took(members, now)
            shape = BatchShape.of(members)
            predicted = lane.cost.predict(shape)
            ends = now + ahead + predicted
            late = [p for p in members if p.deadline is not None and p.deadline < ends]
            admitted = None
            if late:
                # Refused unrun only on a prediction that measurements of comparable
                # batches (or the tuned profile itself) back: a guess turns nothing away.
                admission = lane.cost.admission(shape)  # at most the prediction
                admitted = admission.seconds
                late = [p for p in late if p.deadline < now + ahead + admitted]
            if late:
                self._credit.settled(lane.model, late)
                actions.late.extend((lane.model, self._late(lane, p, ahead, admission, now))
                                    for p in late)
                # The rest finish no later than predicted for the whole batch.
                gone = {id(p) for p in late}
                members = [p for p in members if id(p) not in gone]
                if not members:
                    continue
                shape = BatchShape.of(members)
                predicted = lane.cost.predict(shape)
            check = now + ahead + max(predicted * OVERRUN_FIRST, OVERRUN_MIN_S)
            batch = Batch(lane, members, shape, predicted, now, check, admitted)
            self.in_flight.append(batch)
            actions.start = batch
            return None
        return None

    @staticmethod
    def _late(lane: Lane, pending: Pending, ahead: float, admission: Admission,
              now: float) -> Late:
        assert pending.deadline is not None
        alone = lane.cost.admission(BatchShape.of([pending])).seconds
        return Late(pending, ahead + admission.seconds, pending.deadline - now, admission,
                    alone)

    def busy_for(self, now: float) -> float:
        """Predicted seconds until a batch started now would run: until the runtime has
        no batch in flight, or with `parallel` replicas, while one of them is free, none
        (and else that work shared among them)."""
        if len(self.in_flight) < self.parallel:
            return 0.0
        head, *behind = self.in_flight
        return (head.left_s(now) + sum(batch.predicted_s for batch in behind)) / self.parallel

    def _wake_in(self, now: float, wait: float | None) -> float | None:
        running = self.running
        if running is not None:
            if now + MIN_WAIT_S >= running.check_at:
                running.check_at = now + max(running.predicted_s, OVERRUN_REPEAT_MIN_S)
            overrun = running.check_at - now
            return overrun if wait is None else min(wait, overrun)
        return wait
