"""Fleet experiments with simulated workers: scaling, and pull (shared queue) vs push.

    .venv/bin/python -m bench.fleet scaling --workers 1,2,4,8
    .venv/bin/python -m bench.fleet pull-vs-push --workers 4 --loads 0.5,0.8,0.95
    .venv/bin/python -m bench.fleet pull-vs-push --workers 4 --seeds 1,2,3 \
        --png docs/bench/pull-vs-push.png

Every worker runs the `sim` runtime (no math: it sleeps a + b*T + c*T*L per
batch, see runtimes/doubles/sim), so eight "devices" fit on this 2-core machine; the
constants below make one device about as fast as MiniLM on this CPU, and
every line of output says SIMULATED. The load does not go through HTTP: an
asyncio client publishes shoal task messages (the gateway's own `Broker`)
and awaits the replies, so the gateway's CPU does not cap the fleet.

Scaling: N workers share one queue; closed-loop clients are raised until
p99 passes `--p99-factor` x its low-load value (app.tuning.knee); the knee's
throughput for N workers is compared with N x the one-worker knee.

Pull vs push: the same N workers and the same heavy-tailed request mix
(texts per request drawn from a Pareto distribution), offered as Poisson
arrivals at 50/80/95% of the fleet's measured capacity, (a) through one shared
queue that every worker pulls from (shoal), (b) through a router that assigns
requests round-robin to per-worker queues (each worker still batches what it
is given with the same batch former; only who decides changes). Reports each
worker's device utilisation (simulated busy time / wall time), p50/p99, and
how many messages the broker redelivered (returns, read from the RabbitMQ
management API a stats interval after each load). `--seeds 1,2,3` runs the
whole experiment once per request mix and Poisson schedule and reports every
seed's rows and the median over seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.tuning.bench_stack import BenchStack, bench_stack
from app.tuning.inproc import machine_info
from app.tuning.knee import Point, SweepPolicy, find_knee, next_load
from app.tuning.mix import make_requests
from bench.fleet_load import MODEL, SIM_ENV, Publisher, closed_loop, open_loop
from bench.fleet_report import medians, plot_pull_vs_push, report, whole_ms
from bench.lib.args import add_env, env_of
from tasks.settings import Settings, get_settings
from tasks.topology import queue_for

EXTRA_ENV: dict[str, str] = {}  # --env: worker settings for every fleet of this run


@contextlib.contextmanager
def fleet(workers: int, shared: bool, tag: str) -> Iterator[list[BenchStack]]:
    """`workers` sim workers on one queue (shared) or each on its own queue (push)."""
    base = f"shoal-fleet-{tag}-{uuid.uuid4().hex[:6]}"
    env = {**SIM_ENV, **EXTRA_ENV}
    with contextlib.ExitStack() as stacks:
        if shared:
            yield [stacks.enter_context(bench_stack(MODEL, env, workers=workers,
                                                    prefix=base))]
        else:
            yield [stacks.enter_context(bench_stack(MODEL, env, prefix=f"{base}-w{i}"))
                   for i in range(workers)]


def _prefixes(stacks: list[BenchStack]) -> list[str]:
    return [s.prefix for s in stacks]


async def _sweep(publisher: Publisher, requests: list[list[str]], workers: int,
                 args: argparse.Namespace) -> tuple[list[dict[str, Any]], Any]:
    """Closed-loop clients raised geometrically until past the knee (app.tuning.knee)."""
    policy = SweepPolicy(start=max(1, workers), growth=2.0, max_load=args.max_clients,
                         p99_factor=args.p99_factor)
    points: list[Point] = []
    runs = []
    step = next_load(points, policy)
    while step.load is not None:
        run = await closed_loop(publisher, requests, int(step.load), args.warmup, args.duration)
        summary = run.summary(workers)
        runs.append(summary)
        points.append(Point(step.load, summary["req_per_s"], summary["p50_ms"],
                            summary["p99_ms"]))
        print(f"  {workers} workers, {step.load:g} clients: {summary['req_per_s']:.0f} req/s, "
              f"p99 {summary['p99_ms']:.0f} ms [SIMULATED]", file=sys.stderr)
        step = next_load(points, policy)
    return runs, find_knee(points, args.p99_factor)


async def scaling(args: argparse.Namespace) -> dict[str, Any]:
    requests = make_requests(400, args.items, args.words, seed=args.seed)
    out = []
    for n in args.workers:
        with fleet(n, shared=True, tag=f"scale{n}") as stacks:
            publisher = Publisher(_prefixes(stacks))
            await publisher.start()
            try:
                runs, knee = await _sweep(publisher, requests, n, args)
            finally:
                await publisher.close()
        out.append({"workers": n, "runs": runs,
                    "knee": None if knee is None else asdict(knee.point)})
    return {"experiment": "scaling", "simulated": SIM_ENV, "results": out}


# RabbitMQ's management API refreshes queue statistics every 5 s (collect_statistics_interval).
STATS_LAG_S = 5.5


def redelivered(prefixes: list[str]) -> int | None:
    """Messages the broker has redelivered from the model queues of these stacks so far
    (returns: reject + requeue), or None where the management API cannot be read."""
    base = get_settings().management_url
    url = urllib.parse.urlsplit(base)
    auth = base64.b64encode(f"{url.username or ''}:{url.password or ''}".encode()).decode()
    netloc = url.hostname + (f":{url.port}" if url.port else "")
    root = urllib.parse.urlunsplit((url.scheme, netloc, url.path, "", "")).rstrip("/")
    total = 0
    for prefix in prefixes:
        name = queue_for(MODEL, Settings(queue_prefix=prefix)).name
        request = urllib.request.Request(f"{root}/queues/%2F/{urllib.parse.quote(name, '')}")
        request.add_header("Authorization", f"Basic {auth}")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                stats = json.load(response).get("message_stats") or {}
        except (OSError, ValueError):
            return None
        total += int(stats.get("redeliver", 0))
    return total


async def _redelivered_after_stats(prefixes: list[str]) -> int | None:
    await asyncio.sleep(STATS_LAG_S)
    return redelivered(prefixes)


async def pull_vs_push(args: argparse.Namespace) -> dict[str, Any]:
    """The experiment once per seed (`--seeds`, else `--seed`)."""
    seeds = args.seeds or [args.seed]
    rows: list[dict[str, Any]] = []
    capacities: dict[int, float] = {}
    for seed in seeds:
        one = await pull_vs_push_seed(args, seed)
        capacities[seed] = one["capacity_req_per_s"]
        rows += one["results"]
    return {"experiment": "pull-vs-push", "simulated": SIM_ENV, "workers": args.workers[0],
            "seeds": seeds, "capacity_req_per_s": capacities, "results": rows,
            "medians": medians(rows)}


async def pull_vs_push_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    requests = make_requests(2000, args.items, args.words, seed=seed)
    n = args.workers[0]
    with fleet(n, shared=True, tag="cap") as stacks:
        publisher = Publisher(_prefixes(stacks))
        await publisher.start()
        try:
            saturated = await closed_loop(publisher, requests, args.capacity_clients * n,
                                          args.warmup, args.duration)
        finally:
            await publisher.close()
    capacity = saturated.summary(n)["req_per_s"]
    print(f"  seed {seed}: capacity of {n} workers: {capacity:.0f} req/s [SIMULATED]",
          file=sys.stderr)
    rows = []
    for mode, shared in (("pull: one shared queue", True), ("push: round-robin router", False)):
        with fleet(n, shared=shared, tag="push" if not shared else "pull") as stacks:
            publisher = Publisher(_prefixes(stacks))
            await publisher.start()
            try:
                before = await _redelivered_after_stats(_prefixes(stacks))
                for fraction in args.loads:
                    run = await open_loop(publisher, requests, fraction * capacity,
                                          args.warmup, args.duration, seed=seed)
                    summary = run.summary(n)
                    after = await _redelivered_after_stats(_prefixes(stacks))
                    returned = None if before is None or after is None else after - before
                    before = after
                    summary.update(mode=mode, fraction=fraction, seed=seed,
                                   capacity_req_per_s=capacity, redelivered=returned)
                    rows.append(summary)
                    print(f"  seed {seed}, {mode} at {fraction:.0%}: p99 "
                          f"{summary['p99_ms']:.0f} ms (slowest 1%: queued "
                          f"{whole_ms(summary['tail_queue_ms'])}, batch "
                          f"{whole_ms(summary['tail_inference_ms'])}, rest "
                          f"{whole_ms(summary['tail_rest_ms'])} ms), utilisation "
                          f"{summary['utilisation_mean']:.0%}, redelivered {returned} "
                          "[SIMULATED]", file=sys.stderr)
            finally:
                await publisher.close()
    return {"capacity_req_per_s": capacity, "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=["scaling", "pull-vs-push"])
    parser.add_argument("--workers", default="1,2,4,8",
                        type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("--loads", default="0.5,0.8,0.95",
                        type=lambda v: [float(x) for x in v.split(",")])
    parser.add_argument("--items", default="pareto:1.5:4:64", help="texts per request")
    parser.add_argument("--words", default="uniform:5:15", help="words per text")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--max-clients", type=int, default=256)
    parser.add_argument("--capacity-clients", type=int, default=16,
                        help="closed-loop clients per worker when measuring capacity")
    parser.add_argument("--p99-factor", type=float, default=3.0,
                        help="the knee: p99 within this multiple of its low-load value (a "
                        "batching device's latency grows with its batch, so 3 rather than 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")],
                        help="pull-vs-push: run once per seed (request mix and arrivals), "
                        "e.g. 1,2,3; reports each seed and the medians")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    add_env(parser, "worker settings, e.g. SHOAL_BATCH_MAX_TOKENS=2048")
    args = parser.parse_args(argv)
    EXTRA_ENV.update(env_of(args.env))
    run = scaling if args.experiment == "scaling" else pull_vs_push
    data = asyncio.run(run(args))
    data.update(machine=machine_info(), command=" ".join(sys.argv), env=EXTRA_ENV)
    print(report(data))
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    if args.png and args.experiment == "pull-vs-push":
        plot_pull_vs_push(args.png, data)
    elif args.png:
        from bench.lib.plot import plot_fleet

        plot_fleet(args.png, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
