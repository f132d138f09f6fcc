"""`shoal tune MODEL --device KIND`: find a model's batching knee and write it to its catalog file.

    shoal tune sentence-transformers/all-MiniLM-L6-v2 --device cpu

1. Calibrates the cost model: times the model in process (`ModelHost`, the
   runtime's own code) on batches of the benchmark mix, and fits
   latency = a + b*T (+ c*T*L) by least squares, T and L in the *estimated*
   tokens the scheduler plans with.
2. Searches the batching parameters against the live stack (private gateway +
   worker, restarted per setting): token budget, max items, max delay and hold
   horizon, one parameter at a time over its candidate values (coordinate
   search from the current profile). Each setting is measured by a closed-loop
   sweep (bench.load / bench.knee): its knee is the most throughput before
   p99 passes `--p99-factor` x its low-load value. The best knee wins; within
   `--tie` of the best, the lower p99 wins.
3. Writes the winner into `models/<file>.yaml` under `profiles.<device>`
   (comments and order kept), with a `measured` line saying what it came from.
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

import numpy as np

from bench.knee import Knee, SweepPolicy, find_knee, next_load

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
              reps: int = 3) -> list[tuple[int, int, float]]:
    """(estimated padded tokens, estimated longest, seconds) of in-process batches."""
    from runtimes.base import Request
    from runtimes.host import ModelHost

    host = ModelHost()
    host.load([entry])
    op = entry.operation
    samples = []
    try:
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
                 requests: list[list[str]]) -> Knee | None:
    """The knee of a closed-loop sweep against a fresh stack running `setting`."""
    import uvloop

    from bench.load import items_body, prepare, run_load
    from bench.stack import bench_stack

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
    knee = find_knee(points, args.p99_factor)
    label = ", ".join(f"{k}={v:g}" for k, v in setting.items())
    if knee is None:
        print(f"  {label}: no knee", file=sys.stderr)
        return None
    p = knee.point
    print(f"  {label}: knee {p.throughput:.0f} req/s, p99 {p.p99_ms:.0f} ms at {p.load:g} "
          "clients", file=sys.stderr)
    return knee


def _grid(args: argparse.Namespace) -> dict[str, tuple[float, ...]]:
    grid = {name: values for name, (_, values) in PARAMETERS.items()}
    for item in args.grid:
        name, _, values = item.partition("=")
        if name not in PARAMETERS:
            raise SystemExit(f"--grid: unknown parameter {name!r}; known: {list(PARAMETERS)}")
        grid[name] = tuple(float(v) for v in values.split(","))
    return grid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--device", required=True, help="the profile to write: cpu, l4, h100...")
    parser.add_argument("--catalog-dir", type=Path, help="default: SHOAL_CATALOG_DIR")
    parser.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2",
                        help=f"candidate values of one of {list(PARAMETERS)}")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="settings for the private stack (e.g. SHOAL_RUNTIME=sim)")
    parser.add_argument("--mix-items", default="uniform:1:4")
    parser.add_argument("--mix-words", default="uniform:5:15")
    parser.add_argument("--start", type=float, default=1)
    parser.add_argument("--growth", type=float, default=2.0)
    parser.add_argument("--max-clients", type=float, default=64)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--p99-factor", type=float, default=2.0)
    parser.add_argument("--tie", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=1,
                        help="sweeps per setting, the median knee counts (a noisy host "
                        "needs 3 or more)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="keep the profile's cost constants (e.g. for a sim runtime)")
    parser.add_argument("--dry-run", action="store_true", help="print, do not write")
    args = parser.parse_args(argv)
    args.env = dict(item.split("=", 1) for item in args.env)

    from bench.mix import make_requests
    from tasks.catalog import BatchProfile, Catalog
    from tasks.settings import get_settings

    args.catalog_dir = args.catalog_dir or get_settings().catalog_dir
    catalog = Catalog.from_dir(args.catalog_dir)
    entry = catalog.get(args.model)
    if entry is None:
        print(f"{args.model!r} is not in {args.catalog_dir}", file=sys.stderr)
        return 2
    if entry.operation != "encode":
        print(f"shoal tune drives /v1/encode; {args.model} serves {entry.operation}",
              file=sys.stderr)
        return 2
    requests = make_requests(300, args.mix_items, args.mix_words)
    profile = entry.profile(args.device) or BatchProfile()
    cost = (profile.cost_a_ms, profile.cost_b_us, profile.cost_c_ns)
    if not args.no_calibrate:
        cost = fit_cost(calibrate(entry, requests))
        print(f"cost fit: a={cost[0]:.2f} ms, b={cost[1]:.2f} us/token", file=sys.stderr)
    start = {"max_tokens": float(profile.max_tokens), "max_items": float(profile.max_items),
             "max_delay_ms": profile.max_delay_ms,
             "hold_horizon_batches": profile.hold_horizon_batches or 2.0}
    def measure(setting: dict[str, float]) -> Knee | None:
        knees = [measure_live(args.model, setting, args, requests) for _ in range(args.repeats)]
        return median_knee(knees)

    best, knee, history = coordinate_search(start, _grid(args), measure, args.tie)
    tuned = {
        "max_tokens": int(best["max_tokens"]), "max_items": int(best["max_items"]),
        "max_delay_ms": best["max_delay_ms"],
        "hold_horizon_batches": best["hold_horizon_batches"],
        "cost_a_ms": round(cost[0], 3), "cost_b_us": round(cost[1], 3),
        "cost_c_ns": round(cost[2], 3), "measured": measured_line(knee, args, cost),
    }
    print(f"{len(history)} settings measured; best: {tuned}")
    if not args.dry_run:
        path = catalog.origin(args.model)
        assert path is not None
        write_profile(path, args.device, tuned)
        print(f"wrote profiles.{args.device} to {path}")
    return 0
