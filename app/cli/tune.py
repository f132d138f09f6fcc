"""`shoal tune MODEL --device KIND`: find a model's batching knee and write it to its catalog file.

    shoal tune sentence-transformers/all-MiniLM-L6-v2 --device cpu

0. Chooses the engine (unless `--keep-runtime`, `--no-calibrate` or a SHOAL_RUNTIME in
   `--env`): each engine that can serve the entry (PyTorch; ONNX Runtime for the text
   encoders without LoRAs) is checked against the reference library at onboarding's
   parity bound and timed in process; the fastest that holds the bound is written as
   the profile's `runtime` and `precision`, and the steps below run on it
   (`app/onboard/engine_choice.py`).
1. Calibrates the cost model: times the model in process (`ModelHost`, the
   runtime's own code) on batches of the benchmark mix, and fits
   latency = a + b*T (+ c*T*L) by least squares, T and L in the *estimated*
   tokens the scheduler plans with.
2. Searches the batching parameters against the live stack (private gateway +
   worker, restarted per setting): token budget, max items, max delay and hold
   horizon, one parameter at a time over its candidate values (coordinate
   search from the current profile). Each setting is measured by a closed-loop
   sweep (app.tuning.load / app.tuning.knee): its knee is the most throughput before
   p99 passes `--p99-factor` x its low-load value. The best knee wins; within
   `--tie` of the best, the lower p99 wins.
3. Writes the winner into `models/<file>.yaml` under `profiles.<device>`
   (comments and order kept), with a `measured` line saying what it came from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.tuning.knee import Knee
from app.tuning.tune import (
    PARAMETERS,
    calibrate,
    coordinate_search,
    fit_cost,
    measure_live,
    measured_line,
    median_knee,
    write_profile,
)


def _grid(args: argparse.Namespace) -> dict[str, tuple[float, ...]]:
    grid = {name: values for name, (_, values) in PARAMETERS.items()}
    for item in args.grid:
        name, _, values = item.partition("=")
        if name not in PARAMETERS:
            raise SystemExit(f"--grid: unknown parameter {name!r}; known: {list(PARAMETERS)}")
        grid[name] = tuple(float(v) for v in values.split(","))
    return grid


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tune", help="tune a model's batching profile (app/cli/tune.py)",
                            description=__doc__,
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
                        help="keep the profile's cost constants and engine (e.g. for a sim "
                        "runtime)")
    parser.add_argument("--keep-runtime", action="store_true",
                        help="do not choose the engine: keep the profile's `runtime`")
    parser.add_argument("--dry-run", action="store_true", help="print, do not write")
    parser.set_defaults(run=tune)


def tune(args: argparse.Namespace) -> int:
    from app.tuning.mix import make_requests
    from tasks.catalog import BatchProfile, Catalog
    from tasks.settings import get_settings

    args.env = dict(item.split("=", 1) for item in args.env)
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
    chosen: dict[str, str] = {}
    if not args.no_calibrate:
        samples, chosen = _engine_samples(entry, requests, args)
        cost = fit_cost(samples)
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
        "cost_c_ns": round(cost[2], 3), **chosen,
        "measured": measured_line(knee, args, cost),
    }
    print(f"{len(history)} settings measured; best: {tuned}")
    if not args.dry_run:
        path = catalog.origin(args.model)
        assert path is not None
        write_profile(path, args.device, tuned)
        print(f"wrote profiles.{args.device} to {path}")
    return 0


def _engine_samples(entry: Any, requests: list[list[str]], args: argparse.Namespace
                    ) -> tuple[list[tuple[int, int, float]], dict[str, str]]:
    """The in-process batch times the cost is fitted on, and the profile's `runtime` and
    `precision`: those of the fastest engine whose outputs hold the parity bound
    (`app.onboard.engine_choice`), which the live sweeps then run on; the entry's own
    engine with --keep-runtime or a SHOAL_RUNTIME given in --env."""
    if args.keep_runtime or "SHOAL_RUNTIME" in args.env:
        return calibrate(entry, requests), {}
    from app.onboard.engine_choice import choose_engine

    print("choosing the engine (parity, then in-process rate):", file=sys.stderr)
    best, _ = choose_engine(entry, requests, args.device, calibrate,
                            say=lambda line: print(line, file=sys.stderr))
    if best is None:
        raise SystemExit(f"{entry.id}: no engine holds the parity bound on {args.device}")
    args.env["SHOAL_RUNTIME"] = best.runtime  # the private stack's sweeps run on it
    return best.samples, {"runtime": best.runtime, "precision": best.precision}
