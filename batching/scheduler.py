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
- `clear()`: the connection was lost, the broker redelivers everything held.

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
- the prefetch is per consumer (quorum queues refuse global QoS), so it
  counts only the messages that consumer delivered, and changing it means a
  new consumer (the dispatcher cancels and consumes again) whose credit is
  the whole new prefetch, never less than one message;
- while another consumer of the queue exists, what would not start within the
  hold horizon (a time: `batching.hold`) goes back to the queue (`overflow`),
  except what the current consumer delivered (returning that would reopen its
  credit and draw another at once); a lone worker keeps everything (a return
  would only come back to it);
- with peers, what a worker may take in follows the same bound on every tick
  (`may_hold` beside the running batch, for the recent mean request, tracked
  over arrivals): while the running batch is predicted to end later than the
  horizon, nothing (a new consumer with the least prefetch, so a busy worker
  takes at most one request an idle peer could have started); from when it
  ends within the horizon, the next batch (woken then). A lone worker sets
  its prefetch after each batch, for a full running batch plus the horizon
  (`prefetch_for`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from batching.former import (
    BatchLimits,
    is_full,
    leader,
    seconds_to_wait,
    split_expired,
    take_batch,
)
from batching.hold import (
    HoldLimits,
    MeanRequest,
    credit_opens_in,
    may_hold,
    overflow,
    prefetch_for,
)
from batching.latency_model import Admission, CostModel
from batching.shapes import BatchShape, Pending

# Re-consuming to change prefetch costs two round trips: only for real changes.
PREFETCH_CHANGE_RATIO = 1.5
# How much each arrival moves the lane's mean request: about the last 30 requests count.
MIX_WEIGHT = 1 / 32
# A batch overrunning its prediction is looked at again (for returns) after this much
# of its prediction, then every prediction (at least every OVERRUN_MIN_S).
OVERRUN_FIRST = 1.5
OVERRUN_MIN_S = 0.05
OVERRUN_REPEAT_MIN_S = 0.25
# A batch that would join others in flight while under half full starts once they are
# due to end within this share of its own predicted time.
PIPELINE_LEAD = 0.5
# While a request a caller waits for came this recently, a bulk job's parts do not queue a
# second batch behind one in flight: the next caller would wait for both.
CALLERS_RECENT_S = 1.0
# A wait shorter than this is no wait: a timer cannot be that precise, and one set at the
# rounding error of the clock would fire without time having passed.
MIN_WAIT_S = 1e-4


class RequestMix:
    """An exponentially weighted mean of the requests that arrived (items, longest, cost)."""

    __slots__ = ("mean",)

    def __init__(self) -> None:
        self.mean: MeanRequest | None = None

    def add(self, p: Pending) -> None:
        m = self.mean
        if m is None:
            self.mean = MeanRequest(p.items, p.longest, p.cost)
            return
        w = MIX_WEIGHT
        self.mean = MeanRequest(m.items + w * (p.items - m.items),
                                m.longest + w * (p.longest - m.longest),
                                m.cost + w * (p.cost - m.cost))


@dataclass(slots=True)
class Lane:
    """One served model: its backlog (arrival order), limits, cost model and prefetch.

    A lane that is not `ready` (its model is not loaded) starts no batch and neither
    bounds nor returns what it holds: its requests wait for the load within their
    deadlines, and its consumer's prefetch is the placement's (`app.worker.lifecycle.placement`)."""

    model: str
    limits: BatchLimits
    cost: CostModel
    prefetch: int = 0  # as last applied by the dispatcher
    ready: bool = True
    # Set while every peer would first have to load the model: work is worth handing to
    # one only past this many seconds (its load) of waiting here.
    cold_peers_horizon_s: float | None = None
    backlog: list[Pending] = field(default_factory=list)
    mix: RequestMix = field(default_factory=RequestMix)
    # Since when job parts held here have been passed over (None: none are, or one ran).
    bulk_passed_since: float | None = None
    waited_for_at: float | None = None  # when the last request a caller waits for came

    def callers_active(self, now: float) -> bool:
        """Whether a request a caller waits for came within CALLERS_RECENT_S: job parts
        then run in short pieces, one batch at a time (see `_maybe_start`)."""
        return self.waited_for_at is not None and now - self.waited_for_at < CALLERS_RECENT_S

    def bulk_turn(self, now: float) -> bool:
        """Whether held job parts have waited their turn (`BatchLimits.bulk_pass_s`)."""
        since = self.bulk_passed_since
        return since is not None and now - since >= self.limits.bulk_pass_s

    def took(self, members: list[Pending], now: float) -> None:
        """A batch was taken from the backlog: start or stop the parts' passed-over clock."""
        if any(p.bulk for p in members) or not any(p.bulk for p in self.backlog):
            self.bulk_passed_since = None
        elif self.bulk_passed_since is None:
            self.bulk_passed_since = now


@dataclass(slots=True)
class Batch:
    """The batch the runtime is running."""

    lane: Lane
    members: list[Pending]
    shape: BatchShape
    predicted_s: float
    started: float  # handed to the runtime; once the batches before it ended, from then
    check_at: float  # when to look again at what is held if it has not ended
    # What its members' deadlines were checked against when it formed (at most the
    # prediction: see `CostModel.admission`); None: the prediction itself.
    admitted_s: float | None = None

    def left_s(self, now: float) -> float:
        """Predicted seconds until it ends; past its prediction, assume it overruns by as
        much again as it already has."""
        elapsed = now - self.started
        return max(self.predicted_s - elapsed, elapsed - self.predicted_s, 0.0)


@dataclass(slots=True)
class Late:
    """A request that would finish after its deadline, with the predicted finish."""

    pending: Pending
    predicted_s: float  # until its batch would end: the batches ahead, then its own
    deadline_in_s: float  # from when it would have started
    backing: Admission  # its batch's own prediction and what backs it
    alone_s: float  # the request alone, predicted as a refusal may rely on

    @property
    def too_short(self) -> bool:
        """Alone it is predicted to take longer than its caller's whole deadline: sent
        again as it was, it would be refused again."""
        budget = self.pending.budget_s
        return budget is not None and self.alone_s > budget


@dataclass(slots=True)
class Actions:
    """What `tick` decided, for the dispatcher to apply in this order: answer the
    expired and late requests, start the batch, change prefetch, give back."""

    expired: list[tuple[str, Pending]] = field(default_factory=list)
    late: list[tuple[str, Late]] = field(default_factory=list)
    start: Batch | None = None
    prefetch: dict[str, int] = field(default_factory=dict)  # applied before the returns
    returned: list[tuple[str, list[Pending]]] = field(default_factory=list)
    wake_in: float | None = None  # seconds until `tick` is due again, None: on events only


PeerCount = Callable[[str, float], int]  # (model, now) -> consumers of its queue, us included


class Scheduler:
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
        # Per lane, the requests (ids) its current consumer delivered that are still held
        # or running: a per-consumer prefetch counts only these, and a re-consume starts
        # a new consumer whose credit is the whole new prefetch.
        self._drawn: dict[str, set[int]] = {model: set() for model in lanes}

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
        self._settled(batch.lane.model, batch.members)  # acked once answered, after `tick`
        return batch

    def clear(self) -> None:
        """Forget every held request (the broker redelivers them). A running batch
        still finishes."""
        for lane in self.lanes.values():
            lane.backlog.clear()
        self._adapt = None
        for drawn in self._drawn.values():
            drawn.clear()

    def drop(self, model: str) -> list[Pending]:
        """Take every request held for `model` out (they are answered, e.g. its load
        failed)."""
        lane = self.lanes[model]
        dropped, lane.backlog[:] = list(lane.backlog), []
        self._settled(model, dropped)
        return dropped

    def in_use(self) -> set[str]:
        """The models with a batch running or requests held: none may be evicted."""
        used = {model for model, lane in self.lanes.items() if lane.backlog}
        used.update(batch.lane.model for batch in self.in_flight)
        return used

    def prefetch_applied(self, model: str, prefetch: int) -> None:
        """The dispatcher (re)started the consumer of `model` with this prefetch."""
        self.lanes[model].prefetch = prefetch
        self._drawn[model].clear()

    def tick(self, now: float) -> Actions:
        actions = Actions()
        for lane in self.lanes.values():
            if lane.backlog:
                expired = split_expired(lane.backlog, now)
                self._settled(lane.model, expired)
                actions.expired.extend((lane.model, p) for p in expired)
        wait = None
        if len(self.in_flight) < self.depth:
            wait = self._maybe_start(now, actions)
        if self._adapt is not None:
            if self.peers(self._adapt.model, now) < 2:  # with peers: _bound_holdings
                self._adapt_prefetch(self._adapt, actions)
            self._adapt = None
        credit_in = self._bound_holdings(now, actions)
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
            late = [p for p in members if p.deadline is not None
                    and p.deadline < now + ahead + lane.cost.predict(shape)]
            admitted = None
            if late:
                # Refused unrun only on a prediction that measurements of comparable
                # batches (or the tuned profile itself) back: a guess turns nothing away.
                admission = lane.cost.admission(shape)  # at most the prediction
                admitted = admission.seconds
                late = [p for p in late if p.deadline < now + ahead + admitted]
            if late:
                self._settled(lane.model, late)
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

    def _bound_holdings(self, now: float, actions: Actions) -> float | None:
        """For every lane with peers, keep what it holds and may take in within the hold
        horizon; the seconds until one may take more (None: no such wait).

        What a lane could end up holding is what it holds plus its consumer's open credit
        (its prefetch less what that consumer delivered and is still unsettled). Over
        what `may_hold` allows, it re-consumes with the least prefetch that lowers that
        (a new consumer's credit is the whole new prefetch, at least `min_prefetch`).
        Far under it (by PREFETCH_CHANGE_RATIO), with the allowance less what it holds,
        unless it already holds work beyond the horizon (the allowance counts requests
        of the mean size; the batches actually planned say there is no room).

        Then what would start after the horizon goes back (`overflow`), except what the
        current consumer delivered: returning that would reopen its credit, so the
        broker would hand over another request (or the same one) at once. A re-consume
        just before makes everything held returnable."""
        left = self.busy_for(now)
        opens: float | None = None
        for lane in self.lanes.values():
            if not lane.ready or self.peers(lane.model, now) < 2:
                # Not loaded: what it holds waits for the load. Alone: returning would
                # only loop back here.
                continue
            hold = self._hold_for(lane)
            beyond = (overflow(lane.backlog, lane.limits, hold, lane.cost, left, now)
                      if lane.backlog else [])
            allowed = may_hold(lane.mix.mean, lane.limits, hold, lane.cost, left)
            if allowed is not None:
                self._bound_intake(lane, allowed, len(beyond), actions)
                # Credit opens later only while nothing may be taken in (allowed == 0).
                later = (credit_opens_in(lane.mix.mean, lane.limits, hold, lane.cost,
                                         left) if allowed == 0 else None)
                if later is not None:
                    later = max(later, MIN_WAIT_S)
                    opens = later if opens is None else min(opens, later)
            drawn = self._drawn[lane.model]
            returned = [p for p in beyond if id(p) not in drawn]
            if returned:
                ids = {id(p) for p in returned}
                lane.backlog[:] = [p for p in lane.backlog if id(p) not in ids]
                actions.returned.append((lane.model, returned))
        return opens

    @staticmethod
    def _late(lane: Lane, pending: Pending, ahead: float, admission: Admission,
              now: float) -> Late:
        assert pending.deadline is not None
        alone = lane.cost.admission(BatchShape.of([pending])).seconds
        return Late(pending, ahead + admission.seconds, pending.deadline - now, admission,
                    alone)

    def _hold_for(self, lane: Lane) -> HoldLimits:
        """The hold limits of a lane: with only cold peers, a horizon of their load time."""
        cold = lane.cold_peers_horizon_s
        if cold is None or (self.hold.max_horizon_s is not None
                            and cold <= self.hold.max_horizon_s):
            return self.hold
        return replace(self.hold, horizon_batches=math.inf, max_horizon_s=cold)

    def _bound_intake(self, lane: Lane, allowed: int, beyond: int, actions: Actions) -> None:
        """Re-consume if that lowers what the lane could end up holding past `allowed`
        (after a re-consume, the `beyond` requests past the horizon can go back), or
        raises it far towards `allowed` when nothing held is past the horizon."""
        held = len(lane.backlog)
        could = held + max(0, lane.prefetch - len(self._drawn[lane.model]))
        floor, cap = self.hold.min_prefetch, self.hold.max_prefetch
        kept = held - beyond
        fresh = min(cap, max(floor, allowed - kept))
        if could > allowed:
            if kept + fresh < could:
                self._reconsume(lane, fresh, actions)
        elif (not beyond and allowed >= PREFETCH_CHANGE_RATIO * could
              and kept + fresh >= PREFETCH_CHANGE_RATIO * could):
            # Only a real rise: a consumer already at the cap would otherwise be started
            # again on every tick, and each re-consume leaves a moment without a consumer,
            # when the broker hands messages to the peers.
            self._reconsume(lane, fresh, actions)

    def _reconsume(self, lane: Lane, prefetch: int, actions: Actions) -> None:
        """Have the dispatcher start a new consumer with this prefetch (even an equal one:
        its credit starts afresh)."""
        lane.prefetch = prefetch
        actions.prefetch[lane.model] = prefetch
        self._drawn[lane.model].clear()

    def _settled(self, model: str, pendings: list[Pending]) -> None:
        drawn = self._drawn[model]
        for p in pendings:
            drawn.discard(id(p))

    def _adapt_prefetch(self, lane: Lane, actions: Actions) -> None:
        target = prefetch_for(lane.mix.mean, lane.limits, self.hold, lane.cost,
                              default=lane.prefetch or self.hold.max_prefetch)
        ratio = max(target, 1) / max(lane.prefetch, 1)
        if ratio >= PREFETCH_CHANGE_RATIO or ratio <= 1 / PREFETCH_CHANGE_RATIO:
            self._set_prefetch(lane, target, actions)

    def _set_prefetch(self, lane: Lane, prefetch: int, actions: Actions) -> None:
        if prefetch != lane.prefetch:
            self._reconsume(lane, prefetch, actions)

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
