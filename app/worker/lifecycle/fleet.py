"""This worker's row of the fleet's plan: what to consume, what to stand by for, what to
load ahead (SHOAL_PLACEMENT=fleet).

Every FLEET_TICK_S the pool-state step hands the loop the latest state of each peer
(`app.worker.pool_states`); `decide` turns them and this worker's own snapshot into the
fleet's picture (`batching.fleet.WorkerView`s and the demand each worker reports), the
plan every worker computes alike (`batching.fleet.plan_fleet`), and this worker's
decisions, which `FleetRow` applies on the loop (the step's timer stops when a drain
begins):

- `serve`: the models it consumes (it keeps them, or it is the one that swaps them in);
- `standby`: the models it stops consuming because the plan gives them to others (only
  once nothing is held here for them; the loop also checks that another consumer is on
  the queue, so no queue is ever left without one);
- `preload`: the models it keeps but has not loaded, and that are asked for, loaded before
  their traffic comes here (a second copy of a hot model starts before its first holder
  saturates).

A model it stands by for whose queue has no consumer at all (its holder died, or the
pictures disagree for a moment) is consumed again at the next tick: `FleetRow.follow`
counts the queue's consumers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.worker import metrics
from app.worker.lifecycle.consumers import Consumers
from app.worker.lifecycle.placement import Placement
from batching.fleet import UNASKED_RATE, Demand, Plan, WorkerView, fleet_demand, plan_fleet
from tasks.pool_state import LOADING, RESIDENT

log = logging.getLogger(__name__)

FLEET_TICK_S = 1.0


@dataclass(frozen=True, slots=True)
class FleetDecisions:
    plan: Plan
    demand: dict[str, Demand]
    serve: frozenset[str]
    standby: frozenset[str]
    preload: tuple[str, ...]


def read_state(state: Mapping[str, Any]) -> tuple[WorkerView, dict[str, dict[str, float]],
                                                   dict[str, int], dict[str, float]]:
    """A pool-state message (`tasks.pool_state`) as the plan sees it: the worker, its
    demand report, its models' sizes and load times. A malformed field counts as absent."""
    models = [m for m in state.get("models") or [] if isinstance(m, dict)
              and isinstance(m.get("id"), str)]
    report: dict[str, dict[str, float]] = {}
    sizes: dict[str, int] = {}
    load_s: dict[str, float] = {}
    for m in models:
        report[m["id"]] = {"rate": _number(m.get("rate")), "busy": _number(m.get("busy"))}
        size = _number(m.get("bytes")) or _number(m.get("estimate"))
        if size > 0:
            sizes[m["id"]] = int(size)
        if _number(m.get("load_s")) > 0:
            load_s[m["id"]] = _number(m.get("load_s"))
    view = WorkerView(
        str(state.get("worker", "")), int(_number(state.get("budget_bytes"))),
        frozenset(m["id"] for m in models),
        frozenset(m["id"] for m in models if m.get("state") in (RESIDENT, LOADING)),
        frozenset(m["id"] for m in models if m.get("pinned") is True),
        frozenset(m["id"] for m in models if m.get("warm") is True))
    return view, report, sizes, load_s


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and value == value else 0.0


def decide(me: str, own: Mapping[str, Any], peers: Iterable[Mapping[str, Any]],
           in_use: Mapping[str, int], standing_by: set[str]) -> FleetDecisions:
    """This worker's decisions from its own snapshot and its peers' latest states."""
    views, reports = [], []
    sizes: dict[str, int] = {}
    load_s: dict[str, float] = {}
    for state in [{**own, "worker": me}, *peers]:
        view, report, its_sizes, its_load_s = read_state(state)
        if not view.serves:
            continue  # a farewell, or a worker that serves nothing
        views.append(view)
        reports.append(report)
        for model, size in its_sizes.items():
            sizes[model] = max(size, sizes.get(model, 0))
        for model, seconds in its_load_s.items():
            load_s.setdefault(model, seconds)
    demand = fleet_demand(reports, sizes, load_s)
    plan = plan_fleet(views, demand)
    serve = plan.serves(me)
    mine = next((v for v in views if v.name == me), WorkerView(me, 0, frozenset()))
    standby = frozenset(m for m in mine.serves - serve
                        if m not in standing_by and not in_use.get(m))
    # Only what is asked for: a model nobody asked for is placed, not loaded.
    preload = tuple(sorted((m for m in plan.keep.get(me, frozenset()) - mine.held
                            if m in demand and demand[m].rate > UNASKED_RATE),
                           key=lambda m: (-demand[m].rate, m)))
    return FleetDecisions(plan, demand, serve, standby, preload)


class FleetRow:
    """Applies this worker's row of the plan to its consumers and its placement (loop
    thread)."""

    def __init__(self, placement: Placement, consumers: Consumers) -> None:
        self.placement = placement
        self.consumers = consumers

    def follow(self, me: str, peers: list[dict[str, Any]]) -> None:
        consumers = self.consumers
        decided = decide(me, self.placement.snapshot(), peers, self.placement.in_use(),
                         consumers.standing_by)
        self.placement.follow(decided.plan, me, decided.demand)
        for model in sorted(consumers.standing_by):
            if model in decided.serve or consumers.consumers_of(model) == 0:
                consumers.resume(model)  # given to it, or nobody consumes it
        for model in sorted(decided.standby):
            if consumers.consumers_of(model) >= 2:  # another worker consumes it
                consumers.standby(model)
        for model in decided.preload:
            self.placement.ensure(model, asked=True)
        for model, demand in decided.demand.items():
            metrics.DEMAND.labels(model).set(demand.rate)
            metrics.DEMAND_BUSY.labels(model).set(demand.busy)
            metrics.COPIES.labels(model).set(len(decided.plan.holders(model)))
