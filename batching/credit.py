"""What each lane's consumer may take in, and what a lane gives back to its queue.

The scheduler (`batching.scheduler`) forms and starts batches; this owns the other half
of a tick, the intake side, applying `batching.hold`'s pure bounds to the lanes:

- the prefetch is per consumer (quorum queues refuse global QoS), so it counts only
  the messages that consumer delivered (`drawn`: those still held or running), and
  changing it means a new consumer (the dispatcher cancels and consumes again) whose
  credit is the whole new prefetch, never less than one message;
- while another consumer of the queue exists, what would not start within the hold
  horizon (a time: `batching.hold`) goes back to the queue (`overflow`), except what the
  current consumer delivered (returning that would reopen its credit and draw another
  at once); a lone worker keeps everything (a return would only come back to it);
- with peers, what a worker may take in follows the same bound on every tick
  (`may_hold` beside the running batch, for the recent mean request, tracked over
  arrivals): while the running batch is predicted to end later than the horizon,
  nothing (a new consumer with the least prefetch, so a busy worker takes at most one
  request an idle peer could have started); from when it ends within the horizon, the
  next batch (woken then). A lone worker sets its prefetch after each batch, for a full
  running batch plus the horizon (`prefetch_for`).

Its decisions go into the tick's `Actions` (`prefetch`, `returned`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from batching.hold import HoldLimits, credit_opens_in, may_hold, overflow, prefetch_for
from batching.lanes import MIN_WAIT_S, Actions, Lane, PeerCount
from batching.shapes import Pending

# Re-consuming to change prefetch costs two round trips: only for real changes.
PREFETCH_CHANGE_RATIO = 1.5


class ConsumerCredit:
    """Per lane, the requests its current consumer delivered that are still held or
    running, and the prefetch and return decisions that follow from them."""

    def __init__(self, lanes: dict[str, Lane], hold: HoldLimits, peers: PeerCount) -> None:
        self.lanes = lanes
        self.hold = hold
        self.peers = peers
        # Per lane, ids of what its current consumer delivered, still held or running: a
        # per-consumer prefetch counts only these, and a re-consume starts a new consumer
        # whose credit is the whole new prefetch. The scheduler adds to it on delivery.
        self.drawn: dict[str, set[int]] = {model: set() for model in lanes}

    def settled(self, model: str, pendings: list[Pending]) -> None:
        """These left the worker's hands (answered, refused, given back or dropped)."""
        drawn = self.drawn[model]
        for p in pendings:
            drawn.discard(id(p))

    def applied(self, model: str, prefetch: int) -> None:
        """The dispatcher (re)started the consumer of `model` with this prefetch."""
        self.lanes[model].prefetch = prefetch
        self.drawn[model].clear()

    def forget(self) -> None:
        """The connection was lost: no consumer has delivered anything held."""
        for drawn in self.drawn.values():
            drawn.clear()

    def after_batch(self, lane: Lane, actions: Actions) -> None:
        """A lone worker's lane ended a batch: re-consume if the traffic calls for a
        prefetch far (by PREFETCH_CHANGE_RATIO) from the current one."""
        target = prefetch_for(lane.mix.mean, lane.limits, self.hold, lane.cost,
                              default=lane.prefetch or self.hold.max_prefetch)
        ratio = max(target, 1) / max(lane.prefetch, 1)
        if (ratio >= PREFETCH_CHANGE_RATIO or ratio <= 1 / PREFETCH_CHANGE_RATIO) \
                and target != lane.prefetch:
            self._reconsume(lane, target, actions)

    def bound(self, now: float, left: float, actions: Actions) -> float | None:
        """For every lane with peers, keep what it holds and may take in within the hold
        horizon, the runtime busy for `left` seconds; the seconds until one may take more
        (None: no such wait).

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
            drawn = self.drawn[lane.model]
            returned = [p for p in beyond if id(p) not in drawn]
            if returned:
                ids = {id(p) for p in returned}
                lane.backlog[:] = [p for p in lane.backlog if id(p) not in ids]
                actions.returned.append((lane.model, returned))
        return opens

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
        could = held + max(0, lane.prefetch - len(self.drawn[lane.model]))
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
        self.drawn[lane.model].clear()
