"""bench.pool's scenarios: the deployments each compares and its defaults, each run's
deployment and offered rate, and a round's plan (its rotation or burst)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from bench.pool_fleet import (
    Deployment,
    deployments,
)
from bench.pool_traffic import (
    Plan,
    Rotation,
    make_plan,
    middle_burst,
)

DEPLOYMENTS = ("pool", "pool-nohost", "pool-lru", "router", "mux", "mux-host", "partition")
SCENARIOS: dict[str, dict[str, Any]] = {
    "thrash": {"deployments": ("pool", "pool-lru", "router", "mux", "mux-host", "partition"),
               "slots": 4},
    "fits": {"deployments": ("pool", "mux", "router", "partition"), "slots": 6},
    "shift": {"deployments": ("pool", "router", "mux"), "slots": 4},
    "burst": {"deployments": ("pool", "mux"), "slots": 4},
    "workers": {"deployments": ("pool",), "slots": 4, "sim_speed": 0.1},
}


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """The scenario's defaults for what the command line left out."""
    spec = SCENARIOS[args.scenario]
    args.slots = args.slots or spec["slots"]
    args.sim_speed = args.sim_speed or spec.get("sim_speed", 1.0)
    if args.duration is None:
        args.duration = 3 * args.shift_s if args.scenario == "shift" else 25.0
    names = args.deployments or list(spec["deployments"])
    if args.scenario == "workers":
        names = ["ref-1", *(f"pool-{n}" for n in args.workers)]
    args.deployments = names
    return args


def plans_for(args: argparse.Namespace, models: list[str], halves: Any,
              footprint: int) -> dict[str, tuple[Deployment, float]]:
    """Each run's deployment and offered rate."""
    if args.scenario != "workers":
        plans = deployments(models, halves, footprint, args.slots, args.partition_slots)
        return {name: (plans[name], args.rate) for name in args.deployments}
    out = {}
    ref = deployments(models, halves, footprint, len(models), len(models), workers=1)["pool"]
    out["ref-1"] = (replace(ref, name="ref-1", what=f"one worker, all {len(models)} models "
                            "resident (C1)"), args.per_worker_rate)
    for n in args.workers:
        pool = deployments(models, halves, footprint, args.slots, args.partition_slots,
                           workers=n)["pool"]
        out[f"pool-{n}"] = (replace(pool, name=f"pool-{n}", what=f"{n} workers: {pool.what}"),
                            n * args.per_worker_rate)
    return out


def round_plan(args: argparse.Namespace, rate: float, weights: list[float], seed: int) -> Plan:
    return make_plan(rate, args.warmup + args.duration, weights, seed,
                     rotation=rotation(args), burst=burst(args))


def rotation(args: argparse.Namespace) -> Rotation | None:
    if args.scenario != "shift":
        return None
    return Rotation(args.warmup + args.shift_s, args.shift_s, args.shift_by)


def burst(args: argparse.Namespace) -> Any:
    if args.scenario != "burst":
        return None
    return middle_burst(len(args.models), args.burst_rate, args.burst_s, args.warmup,
                        args.duration)
