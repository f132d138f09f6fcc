"""What the scheduler (`batching.scheduler`) works on and hands back, as plain data.

- `Lane`: one served model: its backlog in arrival order, batch limits, cost model,
  consumer prefetch, the mix of requests that arrived (`RequestMix`) and the clocks that
  give a bulk job's parts their turn beside requests callers wait for;
- `Batch`: a batch handed to the runtime, with its prediction and overrun check;
- `Late`: a request refused unrun, its batch predicted to end after its deadline;
- `Actions`: what one `tick` decided, for the dispatcher to apply.

The dispatcher and the answers read these; only the scheduler changes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from batching.former import BatchLimits
from batching.hold import MeanRequest
from batching.latency_model import Admission, CostModel
from batching.shapes import BatchShape, Pending

# How much each arrival moves the lane's mean request: about the last 30 requests count.
MIX_WEIGHT = 1 / 32
# While a request a caller waits for came this recently, a bulk job's parts do not queue a
# second batch behind one in flight: the next caller would wait for both.
CALLERS_RECENT_S = 1.0
# A wait shorter than this is no wait: a timer cannot be that precise, and one set at the
# rounding error of the clock would fire without time having passed.
MIN_WAIT_S = 1e-4


class RequestMix:
    """An exponentially weighted mean of the requests that arrived (items, longest, cost).

    Kept as three floats, updated per arrival; the `MeanRequest` the credit reads is
    built when read (a few times a tick), not per arrival."""

    __slots__ = ("_cost", "_items", "_longest", "_mean", "_seen")

    def __init__(self) -> None:
        self._seen = False
        self._items: float = 0.0
        self._longest: float = 0.0
        self._cost: float = 0.0
        self._mean: MeanRequest | None = None  # of the arrivals so far, once read

    @property
    def mean(self) -> MeanRequest | None:
        if self._mean is None and self._seen:
            self._mean = MeanRequest(self._items, self._longest, self._cost)
        return self._mean

    def add(self, p: Pending) -> None:
        self._mean = None
        if not self._seen:
            self._seen = True
            self._items, self._longest, self._cost = p.items, p.longest, p.cost
            return
        w = MIX_WEIGHT
        self._items += w * (p.items - self._items)
        self._longest += w * (p.longest - self._longest)
        self._cost += w * (p.cost - self._cost)


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
        then run in short pieces, one batch at a time (`batching.scheduler`)."""
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
