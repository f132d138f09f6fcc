"""The tuner behind `shoal tune` (app/cli/tune.py says what it does, step by step):
calibrate the cost model in process, search the batching parameters against a live
private stack one at a time, and write the winner into a catalog file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from app.tuning.knee import Knee, SweepPolicy, find_knee, next_load
from tasks.engines import DEFAULT

# What the search varies: the catalog profile field, the worker setting that overrides it,
# and the candidate values tried.
PARAMETERS: dict[str, tuple[str, tuple[float, ...]]] = {
    "max_tokens": ("SHOAL_BATCH_MAX_TOKENS", (2048, 4096, 8192, 16384)),
    "max_items": ("SHOAL_BATCH_MAX_ITEMS", (16, 32, 64, 128)),
    "max_delay_ms": ("SHOAL_BATCH_MAX_DELAY_MS", (0.0, 2.0, 5.0)),
    "hold_horizon_batches": ("SHOAL_HOLD_HORIZON_BATCHES", (1.0, 2.0, 4.0)),
}


Measure = Callable[[dict[str, float]], Knee | None]


def better(a: Knee | None, b: Knee | None, tie: float = 0.02) -> bool:
    """Whether knee `a` beats `b`: more throughput, or within `tie` of it with a lower p99."""
    if a is None:
        return False
    if b is None:
        return True
    x, y = a.point, b.point
    if x.throughput > y.throughput * (1 + tie):
        return True
    # A knee's p99 is finite: find_knee never picks a point without one.
    return x.throughput >= y.throughput * (1 - tie) and x.p99_ms < y.p99_ms  # type: ignore[operator]


def coordinate_search(start: dict[str, float], grid: dict[str, Iterable[float]],
                      measure: Measure, tie: float = 0.02
                      ) -> tuple[dict[str, float], Knee | None, list[tuple[dict, Knee | None]]]:
    """Vary one parameter at a time over its candidates, keeping the best so far.

    Returns the best setting, its knee, and every (setting, knee) measured. A
    setting is measured once even when several passes would revisit it.
    """
    seen: dict[tuple, Knee | None] = {}
    history: list[tuple[dict, Knee | None]] = []

    def knee_of(setting: dict[str, float]) -> Knee | None:
        key = tuple(sorted(setting.items()))
        if key not in seen:
            seen[key] = measure(dict(setting))
            history.append((dict(setting), seen[key]))
        return seen[key]

    best = dict(start)
    best_knee = knee_of(best)
    for name, values in grid.items():
        for value in values:
            if value == best.get(name):
                continue
            candidate = {**best, name: value}
            knee = knee_of(candidate)
            if better(knee, best_knee, tie):
                best, best_knee = candidate, knee
    return best, best_knee, history


def median_knee(knees: list[Knee | None]) -> Knee | None:
    """The median-throughput knee of repeated sweeps; None if most found none."""
    found = sorted((k for k in knees if k is not None), key=lambda k: k.point.throughput)
    if len(found) * 2 < len(knees) or not found:
        return None
    return found[(len(found) - 1) // 2]


def fit_cost(samples: list[tuple[int, int, float]], with_c: bool = False
             ) -> tuple[float, float, float]:
    """(a_ms, b_us, c_ns) of latency = a + b*T + c*T*L from (T, L, seconds) samples,
    non-negative least squares (a negative term is dropped and the rest refitted)."""
    import numpy as np  # here: `shoal` parses its command line without numpy

    if not samples:
        raise ValueError("no samples to fit")
    tokens = np.array([s[0] for s in samples], dtype=float)
    longest = np.array([s[1] for s in samples], dtype=float)
    seconds = np.array([s[2] for s in samples], dtype=float)
    columns = {"a": np.ones_like(tokens), "b": tokens}
    if with_c:
        columns["c"] = tokens * longest
    while True:
        names = list(columns)
        matrix = np.stack([columns[n] for n in names], axis=1)
        solution, *_ = np.linalg.lstsq(matrix, seconds, rcond=None)
        negative = [n for n, v in zip(names, solution, strict=True) if v < 0]
        if not negative or len(names) == 1:
            break
        columns.pop(negative[0])
    values = {n: max(0.0, float(v)) for n, v in zip(names, solution, strict=True)}
    return values.get("a", 0.0) * 1e3, values.get("b", 0.0) * 1e6, values.get("c", 0.0) * 1e9


def write_profile(path: Path, device: str, profile: dict[str, Any]) -> None:
    """Set `profiles.<device>` in a catalog file, keeping its comments and key order."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    data = yaml.load(path.read_text(encoding="utf-8"))
    profiles = data.setdefault("profiles", {})
    current = profiles.get(device) or {}
    current.update(profile)
    profiles[device] = current
    with path.open("w", encoding="utf-8") as out:
        yaml.dump(data, out)


def calibrate(entry: Any, requests: list[list[str]], sizes: Iterable[int] = (1, 4, 16, 64),
              reps: int = 3, engine: str = DEFAULT, precision: str | None = None
              ) -> list[tuple[int, int, float]]:
    """(estimated padded tokens, estimated longest, seconds) of in-process batches, on
    `engine` (a process engine of `tasks.engines`) at `precision` (None: the entry's)."""
    from runtimes.base import Request
    from runtimes.child_side.host import ModelHost

    host = ModelHost(engine=engine, precision=precision)
    host.load([entry])
    op = entry.operation
    samples = []
    try:
        # Untimed: a first batch pays one-off costs (an ONNX session's first run, lazy
        # kernels) that would skew the fit.
        host.run_batch(entry.id, [Request("warm", op, {"model": entry.id, "items": [
            {"text": t} for t in requests[0]]})])
        for size in sizes:
            for rep in range(reps):
                batch = requests[rep * size:(rep + 1) * size] or requests[:size]
                kwargs = [{"model": entry.id, "items": [{"text": t} for t in texts]}
                          for texts in batch]
                estimates = [entry.estimate(k) for k in kwargs]
                items = sum(e[0] for e in estimates)
                longest = max(e[2] for e in estimates)
                started = time.perf_counter()
                host.run_batch(entry.id, [Request(str(i), op, k) for i, k in enumerate(kwargs)])
                samples.append((items * longest, longest, time.perf_counter() - started))
    finally:
        host.close()
    return samples


def measured_line(knee: Knee | None, args: argparse.Namespace, cost: tuple) -> str:
    date = dt.date.today().isoformat()
    where = f"{platform.machine()}, {platform.node()}"
    what = ("no knee found" if knee is None else
            f"knee {knee.point.throughput:.0f} req/s, p99 {knee.point.p99_ms:.0f} ms at "
            f"{knee.point.load:.0f} clients")
    return (f"shoal tune --device {args.device} --mix-items {args.mix_items} --mix-words "
            f"{args.mix_words} on {date} ({where}): {what}; cost fit a={cost[0]:.1f} ms "
            f"b={cost[1]:.1f} us/token")


def measure_live(model: str, setting: dict[str, float], args: argparse.Namespace,
                 requests: list[list[str]], curve: list | None = None) -> Knee | None:
    """The knee of a closed-loop sweep against a fresh stack running `setting`; the
    sweep's points are added to `curve` when one is given."""
    import uvloop

    from app.tuning.bench_stack import bench_stack
    from app.tuning.load import items_body, prepare, run_load

    env = {**args.env, "SHOAL_CATALOG_DIR": str(args.catalog_dir)}
    env.update({PARAMETERS[name][0]: f"{value:g}" for name, value in setting.items()})
    policy = SweepPolicy(start=args.start, growth=args.growth, max_load=args.max_clients,
                         p99_factor=args.p99_factor)
    points = []
    probe = (f"/v1/encode/{model}", json.dumps(items_body(requests[0])).encode())
    with bench_stack(model, env, probe) as stack:
        prepared = prepare(f"{stack.url}/v1/encode/{model}", requests)
        step = next_load(points, policy)
        while step.load is not None:
            result = uvloop.run(run_load(stack.url + f"/v1/encode/{model}", prepared,
                                         "closed", step.load, warmup=args.warmup,
                                         duration=args.duration))
            points.append(result.point())
            step = next_load(points, policy)
    if curve is not None:
        curve.extend(points)
    knee = find_knee(points, args.p99_factor)
    label = ", ".join(f"{k}={v:g}" for k, v in setting.items())
    if knee is None:
        print(f"  {label}: no knee", file=sys.stderr)
        return None
    p = knee.point
    print(f"  {label}: knee {p.throughput:.0f} req/s, p99 {p.p99_ms:.0f} ms at {p.load:g} "
          "clients", file=sys.stderr)
    return knee
