"""Many models on few devices: the pool (any worker loads any model) against the routers a
user would pick, in scenarios.

    .venv/bin/python -m bench.pool --scenario thrash --rounds 3 --png docs/bench/pool.png

Twelve catalog models whose operation is `encode` with dense outputs, with Zipf(s)
popularity (rank 1 the most asked for; tiers: head = ranks 1-2, torso = 3-6, tail =
7-12), served by SIMULATED workers (`SHOAL_RUNTIME=sim`: real Celery and RabbitMQ, batches
and loads sleep). Each deployment runs on fresh private queue prefixes, everything
stopped between deployments; every deployment of a round gets the same arrivals (the
round's seed), and each round rotates the running order. Deployments (`--deployments`):

- pool: every worker may serve all 12 (SHOAL_PIN= none), budget `--slots` models,
  SHOAL_PLACEMENT=fleet (demand-aware) and the host-memory tier on (room for all 12);
- pool-lru: the same with SHOAL_PLACEMENT=lru and no host tier (the pool before issue 51);
- mux: a multiplexing router (like Ray Serve's model multiplexing): N replicas, each a
  worker serving all 12 (lru, no host tier, budget `--slots`) on its own queue prefix;
  the client routes each request (bench.pool_mux.MuxRouter: to a replica that holds the
  model, least outstanding first; else to the least busy replica, which loads it);
- mux-host: the same with the host tier on (room for all 12): how much is the tier;
- partition: 6 models per worker, pinned, budget `--partition-slots` (all resident);
- router: the same 6 + 6 split with the `--slots` budget, nothing pinned (lru).
Every deployment but pool and mux-host has SHOAL_HOST_MEMORY_BYTES=0. The split gives each
worker half of the traffic (`--partition balanced`: ranks 1, 8-12 and ranks 2-7 with
Zipf(1.1)); `--partition contiguous` is ranks 1-6 and 7-12.

Scenarios (`--scenario`):

- thrash (default): 2 workers, 4 slots each, 2 s loads, 70 req/s; pool, pool-lru, router,
  mux, mux-host, partition;
- fits: the same with 6 slots (everything fits on the two workers); pool, mux, router,
  partition; the loads after warm-up are reported;
- shift: the ranking rotates every `--shift-s` s from the window's start + `--shift-s` on
  (rank r's traffic moves to the model that was rank r + `--shift-by`); the window is
  `--duration` (default 3 x `--shift-s`: two rotations, each followed by a whole
  period); pool, router (its split made for the first ranking), mux; p99 in
  `--bucket-s` buckets, and per rotation the recovery time: from the rotation until
  p99 is back within `--recovery-factor` x the p99 of the half period before it, for
  good;
- burst: steady traffic plus `--burst-rate` req/s of the rank-12 model for `--burst-s`
  s in the window's middle; the head's p99 during the burst and outside it, and the
  burst's p50/p99; pool, mux;
- workers: the pool with N = each of `--workers` workers at N x `--per-worker-rate`
  (default sim speed 0.1, loads kept at 2 s of wall time), beside `ref-1`: one worker
  with all 12 models resident at the same per-worker rate. One worker's knee throughput
  C1 is taken as ref-1's completed req/s: its saturated throughput when nothing needs
  loading (the per-worker rate is meant to be above it; the table says when ref-1 was
  not saturated). Efficiency = req/s / (N x C1); the goal reads efficiency >= 0.9 at
  N = 8 with every tier served. The client's send rate and lateness, the machine's CPU
  and each worker's cores say whether the client or the machine, not the fleet, is the
  limit.

The catalog (a private SHOAL_CATALOG_DIR) gives every model one `cpu` profile: a batch
sleeps a + b*T (T padded tokens; `--cost-a-ms`, `--cost-b-us`), a load sleeps
`--load-ms` (from the host tier: `--host-load-ms`), a model takes `--footprint-mib`; all
times divided by `--sim-speed`. A budget is its slots' footprints plus 10% of one.

The client publishes shoal task messages itself (the gateway's `Broker` class) at Poisson
arrival times, each request carrying 1-4 texts of 5-15 words. Counted over the window
after `--warmup` s: requests scheduled in it (latency from the scheduled send to the
reply, per tier), errors, successes completed in it (req/s), each worker's simulated busy
time (device util), loads and evictions per minute from the workers' Prometheus counters
read at the window's edges. `--real` runs real workers (pytorch) on twelve tiny random
BERT encoders built at run time (thrash with pool and mux). Every line says SIMULATED or
REAL.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.tuning.inproc import machine_info
from bench.lib.args import int_list
from bench.lib.output import emit
from bench.pool_fleet import (
    MIB,
    Client,
    Deployment,
    MuxClient,
    drive,
    fleet,
    write_catalog,
    write_real_catalog,
)
from bench.pool_report import plot, table
from bench.pool_scenarios import (
    DEPLOYMENTS,
    SCENARIOS,
    burst,
    plans_for,
    resolve,
    rotation,
    round_plan,
)
from bench.pool_stats import (
    POOLS,
    ROUTERS,
    burst_stats,
    counter_delta,
    log_events,
    medians,
    parse_counters,
    percentile,
    ratios,
    rotation_stats,
    summarize,
)
from bench.pool_traffic import (
    MODELS,
    TIERS,
    Plan,
    make_plan,
    schedule,
    split_models,
    tier_of,
    tier_shares,
    zipf_weights,
)

__all__ = ["MODELS", "TIERS", "counter_delta", "log_events", "make_plan", "parse_counters",
           "percentile", "schedule", "split_models", "tier_of", "tier_shares", "zipf_weights"]


async def run_one(deployment: Deployment, plan: Plan, args: argparse.Namespace,
                  catalog_dir: Path, log_root: Path, models: list[str],
                  weights: list[float]) -> dict[str, Any]:
    started = time.perf_counter()
    with fleet(deployment, catalog_dir, args.sim_speed, log_root, args.real) as f:
        client: Client | MuxClient = (
            MuxClient(f.prefixes, models, catalog_dir, deployment.slots)
            if deployment.own_queues else Client(f.prefixes[0], models, catalog_dir))
        await client.start()
        try:
            window = await drive(client, plan, args.warmup, args.duration, f.metrics_urls,
                                 args.timeout, f.pids)
        finally:
            await client.close()
        row = summarize(window, f.worker_names, weights)
        logs = {name: log_events((f.log_dir / f"{name}.log").read_text(errors="replace"))
                for name in f.worker_names}
    row["workers"] = len(deployment.workers)
    row["offered_tier_per_s"] = {t: (row[t]["requests"] + row[t]["errors"]) / args.duration
                                 for t, _, _ in TIERS}
    if isinstance(client, MuxClient):
        row["mux_routed"] = client.routed
        row["mux_mirror"] = [[models[m] for m in held] for held in client.router.held]
    end = args.warmup + args.duration
    if (rot := rotation(args)) is not None:
        row["shift"] = rotation_stats(window.outcomes, window.run_start, (args.warmup, end),
                                      rot.times(end), args.bucket_s, args.recovery_factor)
    if (b := burst(args)) is not None:
        row["burst"] = burst_stats(window.outcomes, window.run_start, b)
    row["worker_logs"] = {f"w{i}": logs[name] for i, name in enumerate(f.worker_names)}
    row["log_dir"] = str(f.log_dir)
    row["seconds"] = time.perf_counter() - started
    return row


def scaling(rows: list[dict[str, Any]]) -> float | None:
    """workers: each row's efficiency against ref-1 in its round and what limited it; the
    median C1."""
    refs = {r["round"]: r for r in rows if r["deployment"] == "ref-1"}
    for row in rows:
        cpu = row.get("cpu") or {}
        late = (row["send_lag_p99_ms"] or 0) > 100 or (
            row["client_sent_per_s"] < 0.95 * row["offered_per_s"])
        if (cpu.get("machine") or 0) > 0.9:
            row["limit"] = "machine CPU"
        elif late or (cpu.get("client_cores") or 0) > 0.9:
            row["limit"] = "client"
        elif row["utilisation_mean"] > 0.85:
            row["limit"] = "fleet (devices busy)"
        elif row["req_per_s"] < 0.95 * row["offered_per_s"]:
            row["limit"] = "fleet (devices idle while requests wait: placement)"
        else:
            row["limit"] = "not saturated"
        ref = refs.get(row["round"])
        if row["deployment"] != "ref-1" and ref and ref["req_per_s"]:
            row["efficiency"] = row["req_per_s"] / (row["workers"] * ref["req_per_s"])
    knees = sorted(r["req_per_s"] for r in refs.values())
    return knees[len(knees) // 2] if knees else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    models = list(args.models)
    weights = zipf_weights(len(models), args.zipf_s)
    halves = split_models(weights, args.partition)
    footprint = int(args.footprint_mib * MIB)
    scale = args.sim_speed if args.scenario == "workers" else 1.0  # loads keep their wall time
    profile = {"max_tokens": 4096, "max_items": 64, "cost_a_ms": args.cost_a_ms,
               "cost_b_us": args.cost_b_us, "cost_c_ns": 0.0, "load_ms": args.load_ms * scale,
               "host_load_ms": args.host_load_ms * scale, "footprint_bytes": footprint,
               "measured": "bench.pool: simulated constants, the same for every model"}
    catalog_dir = Path(tempfile.mkdtemp(prefix="shoal-pool-catalog-"))
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="shoal-pool-logs-"))
    log_root.mkdir(parents=True, exist_ok=True)
    if args.real:
        real_profile = {k: v for k, v in profile.items() if k != "footprint_bytes"}
        real_profile["measured"] = "bench.pool --real: seed constants, refined online"
        footprint = write_real_catalog(catalog_dir, models, real_profile)
        profile["footprint_bytes"] = footprint  # measured weight files, for the report
    else:
        write_catalog(catalog_dir, models, profile)
    plans = plans_for(args, models, halves, footprint)
    kind = "REAL (tiny models)" if args.real else "SIMULATED"
    order = schedule(args.rounds, args.deployments)
    rows: list[dict[str, Any]] = []
    began = time.perf_counter()
    try:
        with tqdm(total=len(order), unit="run", desc=f"bench.pool {args.scenario} [{kind}]",
                  file=sys.stderr) as bar:
            for r, name in order:
                seed = args.seed + r
                deployment, rate = plans[name]
                plan = round_plan(args, rate, weights, seed)
                bar.set_postfix_str(f"round {r + 1} {name}")
                row = asyncio.run(run_one(deployment, plan, args, catalog_dir, log_root,
                                          models, weights))
                row.update(round=r + 1, seed=seed, deployment=name, rate=rate)
                rows.append(row)
                bar.write(f"  [{time.perf_counter() - began:.0f} s] round {r + 1} {name}: "
                          f"{row['req_per_s']:.1f} req/s, p99 head {row['head']['p99_ms'] or 0:.0f}"
                          f" torso {row['torso']['p99_ms'] or 0:.0f} tail "
                          f"{row['tail']['p99_ms'] or 0:.0f} ms, errors {row['errors']}, loads "
                          f"{row['loads_per_min']:.0f}/min, evictions "
                          f"{row['evictions_per_min']:.0f}/min, device util "
                          f"{row['utilisation_mean']:.0%} [{kind}]", file=sys.stderr)
                bar.update()
    finally:
        shutil.rmtree(catalog_dir, ignore_errors=True)
    knee = scaling(rows) if args.scenario == "workers" else None
    workers = sorted({len(d.workers) for d, _ in plans.values()})
    per_worker = args.scenario == "workers"
    return {
        "experiment": "pool", "scenario": args.scenario, "simulated": not args.real,
        "models": models, "weights": weights, "tier_shares": tier_shares(weights),
        "halves": [[models[i] for i in h] for h in halves],
        "halves_share": [sum(weights[i] for i in h) for h in halves],
        "order": list(args.deployments),
        "deployments": {k: asdict(d) for k, (d, _) in plans.items()},
        "profile": profile, "sim_speed": args.sim_speed, "rate": args.rate,
        "rate_text": (f"{args.per_worker_rate:g} req/s per worker, Poisson" if per_worker
                      else f"{args.rate:g} req/s Poisson"),
        "workers_text": f"{'/'.join(map(str, workers))} sim workers" if not args.real
        else f"{'/'.join(map(str, workers))} real workers",
        "slots": args.slots, "partition_slots": args.partition_slots, "zipf_s": args.zipf_s,
        "warmup": args.warmup, "duration": args.duration,
        "shift_s": args.shift_s, "shift_by": args.shift_by, "bucket_s": args.bucket_s,
        "recovery_factor": args.recovery_factor,
        "burst": {"rank": len(models), "rate": args.burst_rate, "seconds": args.burst_s},
        "knee": knee, "knee_text": (
            f"{knee:.1f} req/s (ref-1's completed req/s, median)" if knee else "-"),
        "rows": rows, "medians": medians(rows),
        "ratios": {"partition": ratios(rows, "partition"),
                   "router": ratios(rows, ROUTERS, POOLS)},
        "log_root": str(log_root), "seconds": time.perf_counter() - began,
    }


def _deployments(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEPLOYMENTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(DEPLOYMENTS)}")
    return names


def _models(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) != 12:
        raise argparse.ArgumentTypeError(f"give 12 model ids, most popular first "
                                         f"(got {len(names)})")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=list(SCENARIOS), default="thrash")
    p.add_argument("--rounds", type=int, default=3,
                   help="each round runs every deployment with one seed")
    p.add_argument("--seed", type=int, default=1, help="of round 1 (round r: seed + r - 1)")
    p.add_argument("--rate", type=float, default=70.0, help="Poisson arrivals per second")
    p.add_argument("--duration", type=float,
                   help="measured seconds (default 25; shift: 3 x --shift-s)")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds of load before the window (the pools fill)")
    p.add_argument("--timeout", type=float, default=30.0, help="each request's deadline, s")
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--models", type=_models, default=list(MODELS),
                   help="12 comma-separated catalog ids (encode), most popular first")
    p.add_argument("--partition", choices=["balanced", "contiguous"], default="balanced",
                   help="how partition and router split the models between the workers")
    p.add_argument("--deployments", type=_deployments,
                   help="comma-separated, of " + ", ".join(DEPLOYMENTS)
                   + " (default: the scenario's)")
    p.add_argument("--slots", type=int,
                   help="models per worker's budget (all but partition; default 4, fits: 6)")
    p.add_argument("--partition-slots", type=int, default=6,
                   help="models per worker's budget (partition)")
    p.add_argument("--footprint-mib", type=float, default=100.0)
    p.add_argument("--load-ms", type=float, default=2000.0)
    p.add_argument("--host-load-ms", type=float, default=200.0,
                   help="sim: a reload from the host-memory tier")
    p.add_argument("--cost-a-ms", type=float, default=10.0, help="sim: ms per batch")
    p.add_argument("--cost-b-us", type=float, default=200.0, help="sim: us per padded token")
    p.add_argument("--sim-speed", type=float,
                   help="SHOAL_SIM_SPEED: divides batch and load times (default 1; workers: "
                   "0.1, with loads scaled so that they still take --load-ms of wall time)")
    p.add_argument("--shift-s", type=float, default=60.0, help="shift: s between rotations")
    p.add_argument("--shift-by", type=int, default=4, help="shift: ranks each rotation moves")
    p.add_argument("--bucket-s", type=float, default=5.0, help="shift: p99 bucket width, s")
    p.add_argument("--recovery-factor", type=float, default=1.5,
                   help="shift: recovered = p99 within this x the steady p99")
    p.add_argument("--burst-s", type=float, default=10.0, help="burst: its length, s")
    p.add_argument("--burst-rate", type=float, default=20.0,
                   help="burst: req/s of the rank-12 model")
    p.add_argument("--workers", type=int_list, default=[1, 4, 8],
                   help="workers: fleet sizes to run")
    p.add_argument("--per-worker-rate", type=float, default=12.0,
                   help="workers: offered req/s per worker (meant to saturate one)")
    p.add_argument("--real", action="store_true",
                   help="real workers and tiny real models instead of the sim")
    p.add_argument("--log-dir", type=Path,
                   help="keep the workers' logs here (default: a temporary folder)")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path, help="e.g. docs/bench/pool.png")
    return p


def main(argv: list[str] | None = None) -> int:
    args = resolve(parser().parse_args(argv))
    data = run(args)
    data.update(machine=machine_info(), command=" ".join(["python -m bench.pool", *(
        argv if argv is not None else sys.argv[1:])]))
    print(f"worker logs: {data['log_root']}; {data['seconds']:.0f} s", file=sys.stderr)
    if args.png:
        plot(args.png, data)
    return emit(table(data), data, args.json)


if __name__ == "__main__":
    sys.exit(main())
