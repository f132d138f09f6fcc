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
import random
import statistics
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.bench_stack import BenchStack, bench_stack
from app.tuning.inproc import machine_info
from app.tuning.knee import Point, SweepPolicy, find_knee, next_load
from app.tuning.mix import make_requests
from gateway.broker.link import Broker
from tasks.catalog import load_catalog
from tasks.envelope import task_part
from tasks.served import read_served
from tasks.settings import Settings, get_settings
from tasks.topology import queue_for

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# One simulated device: 40 ms per batch plus 0.2 ms per padded token, and
# requests of 4-64 texts. Deliberately slow: the pipeline costs ~3 ms of CPU per
# request here (client, broker, worker), so eight fast devices would measure
# the 2-core machine, not how the fleet shares work. The fixed cost per batch
# makes batching pay, as on a GPU.
SIM_ENV = {"SHOAL_RUNTIME": "sim", "SHOAL_SIM_COST_A_MS": "40", "SHOAL_SIM_COST_B_US": "200",
           "SHOAL_SIM_COST_C_NS": "0"}


@dataclass
class Outcome:
    latency_ms: float
    items: int
    busy_ms: float  # this request's share of its batch's simulated device time
    worker: str
    ok: bool
    sent: float = 0.0  # perf_counter seconds
    done: float = 0.0
    queue_ms: float | None = None  # publish to the start of its batch (the worker's stamp)
    inference_ms: float = 0.0  # its batch's run time


@dataclass
class Run:
    label: str
    offered: float  # clients (closed) or req/s (open)
    duration: float
    outcomes: list[Outcome] = field(default_factory=list)
    dropped: int = 0

    def summary(self, workers: int) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.ok]
        latencies = sorted(o.latency_ms for o in ok)
        cuts = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
        busy: dict[str, float] = {}
        for o in ok:
            busy[o.worker] = busy.get(o.worker, 0.0) + o.busy_ms
        # The device time of the counted requests, over the wall time they took to serve
        # (under overload they finish after the window, so the window alone is too short).
        span_s = (max(o.done for o in ok) - min(o.sent for o in ok)) if ok else self.duration
        span_s = max(span_s, self.duration) if all(o.done for o in ok) else self.duration
        utilisation = sorted(b / (span_s * 1000) for b in busy.values())
        utilisation += [0.0] * (workers - len(utilisation))
        # Where the tail's time went: the slowest 1% of requests, split into queueing
        # (broker and worker, to the start of their batch), their batch, and the rest
        # (publishing, replies, the client's own loop).
        tail = sorted(ok, key=lambda o: o.latency_ms)[-max(1, len(ok) // 100):] if ok else []
        timed = [o for o in tail if o.queue_ms is not None]
        return {
            "tail_queue_ms": statistics.fmean(o.queue_ms for o in timed) if timed else None,
            "tail_inference_ms": statistics.fmean(o.inference_ms for o in tail) if tail else None,
            "tail_rest_ms": (statistics.fmean(o.latency_ms - o.queue_ms - o.inference_ms
                                              for o in timed) if timed else None),
            "label": self.label, "offered": self.offered, "requests": len(ok),
            "errors": len(self.outcomes) - len(ok), "dropped": self.dropped,
            "req_per_s": len(ok) / self.duration,
            "items_per_s": sum(o.items for o in ok) / self.duration,
            "p50_ms": cuts[49], "p99_ms": cuts[98],
            "utilisation_mean": statistics.fmean(utilisation) if utilisation else 0.0,
            "utilisation_min": min(utilisation, default=0.0),
            "utilisation_max": max(utilisation, default=0.0),
        }


class Publisher:
    """Publishes shoal task messages to one or more queues (round-robin) and awaits replies."""

    def __init__(self, prefixes: list[str]) -> None:
        self.brokers = [Broker(Settings(queue_prefix=p, models=[MODEL]), [MODEL])
                        for p in prefixes]
        (self.entry,) = load_catalog(Settings().catalog_dir).require([MODEL])
        self.next = 0

    async def start(self) -> None:
        for broker in self.brokers:
            broker.start()
        deadline = time.monotonic() + 30
        while not all(b.ready for b in self.brokers):
            if time.monotonic() > deadline:
                raise TimeoutError("the broker connections did not come up")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for broker in self.brokers:
            await broker.close()

    async def call(self, texts: list[str], timeout_s: float = 60.0) -> Outcome:
        broker = self.brokers[self.next % len(self.brokers)]
        self.next += 1
        kwargs = {"model": MODEL, "items": [{"text": t} for t in texts]}
        # What the gateway sends: the entry's estimate, batched replies, coalescing.
        part = task_part(self.entry, kwargs, int(timeout_s * 1000))
        items = len(texts)
        started = time.perf_counter()
        try:
            reply = await broker.submit(MODEL, part, timeout_s)
        except Exception:
            return Outcome((time.perf_counter() - started) * 1000, items, 0.0, "", False)
        done = time.perf_counter()
        latency = (done - started) * 1000
        result = reply.get("result")
        served = read_served(result if isinstance(result, dict) else {})
        batch = served.batch or {}
        ok = reply.get("status") == "SUCCESS"
        share = batch.get("inference_ms", 0.0) / max(1, batch.get("requests", 1))
        timing = served.timing or {}
        queue_ms = timing.get("queue_ms")
        return Outcome(latency, items, share if ok else 0.0, str(served.worker), ok,
                       started, done, None if queue_ms is None else float(queue_ms),
                       float(batch.get("inference_ms", 0.0)))


async def closed_loop(publisher: Publisher, requests: list[list[str]], clients: int,
                      warmup: float, duration: float) -> Run:
    run = Run(f"closed {clients}", clients, duration)
    start = time.perf_counter() + warmup
    end = start + duration

    async def client(k: int) -> None:
        i = k
        while time.perf_counter() < end:
            outcome = await publisher.call(requests[i % len(requests)])
            i += clients
            if start <= time.perf_counter() <= end:
                run.outcomes.append(outcome)

    await asyncio.gather(*(client(k) for k in range(clients)))
    return run


async def open_loop(publisher: Publisher, requests: list[list[str]], rate: float,
                    warmup: float, duration: float, seed: int = 0,
                    max_outstanding: int = 2000) -> Run:
    """Poisson arrivals at `rate` req/s; the schedule never waits for replies."""
    run = Run(f"open {rate:.0f}/s", rate, duration)
    rng = random.Random(seed)
    start = time.perf_counter() + warmup
    end = start + duration
    tasks: set[asyncio.Task] = set()

    async def one(texts: list[str], counted: bool) -> None:
        outcome = await publisher.call(texts)
        if counted:
            run.outcomes.append(outcome)

    at, i = time.perf_counter(), 0
    while at < end:
        at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        if len(tasks) >= max_outstanding:
            run.dropped += 1
            continue
        task = asyncio.create_task(one(requests[i % len(requests)], start <= at <= end))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    await asyncio.gather(*tasks)
    return run


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
                          f"{_ms(summary['tail_queue_ms'])}, batch "
                          f"{_ms(summary['tail_inference_ms'])}, rest "
                          f"{_ms(summary['tail_rest_ms'])} ms), utilisation "
                          f"{summary['utilisation_mean']:.0%}, redelivered {returned} "
                          "[SIMULATED]", file=sys.stderr)
            finally:
                await publisher.close()
    return {"capacity_req_per_s": capacity, "results": rows}


def _mode(row: dict[str, Any]) -> str:
    return "pull" if row["mode"].startswith("pull") else "push"


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per load, the median over seeds of each side's p50, p99 and utilisation, and of the
    per-seed ratio pull p99 / push p99 (pairs of one seed: the same mix and schedule)."""
    out = []
    for fraction in sorted({r["fraction"] for r in rows}):
        at = [r for r in rows if r["fraction"] == fraction]
        row: dict[str, Any] = {"fraction": fraction}
        for side in ("pull", "push"):
            mine = [r for r in at if _mode(r) == side]
            for key in ("p50_ms", "p99_ms", "utilisation_mean", "req_per_s"):
                row[f"{side}_{key}"] = statistics.median(r[key] for r in mine) if mine else None
        pairs = [(p, q) for p in at for q in at
                 if _mode(p) == "pull" and _mode(q) == "push" and p["seed"] == q["seed"]]
        row["p99_ratio"] = (statistics.median(p["p99_ms"] / q["p99_ms"] for p, q in pairs)
                            if pairs else None)
        row["seeds"] = len(pairs)
        out.append(row)
    return out


_pct = partial(markdown.dash, spec=".0%")
_ms = partial(markdown.dash, spec=".0f")


def pull_vs_push_report(data: dict[str, Any]) -> list[str]:
    capacities = data["capacity_req_per_s"]
    if not isinstance(capacities, dict):  # a result file of one seed, before --seeds
        capacities = {data.get("seed", "-"): capacities}
    lines = [f"{data['workers']} workers; capacity (closed loop, saturated, pull) per seed: "
             + ", ".join(f"seed {s}: {c:.0f} req/s" for s, c in capacities.items()), "",
             *markdown.table(["seed", "load", "pull p50 ms", "pull p99 ms", "push p50 ms",
                              "push p99 ms", "pull/push p99", "pull util (min-max)",
                              "push util (min-max)", "pull redelivered"], align="l" * 10)]
    rows = data["results"]
    keys = sorted({(r.get("seed", "-"), r["fraction"]) for r in rows}, key=str)
    for seed, fraction in keys:
        pull = next((r for r in rows if r.get("seed", "-") == seed and r["fraction"] == fraction
                     and _mode(r) == "pull"), None)
        push = next((r for r in rows if r.get("seed", "-") == seed and r["fraction"] == fraction
                     and _mode(r) == "push"), None)

        def util(r: dict[str, Any] | None) -> str:
            if r is None:
                return "-"
            return (f"{r['utilisation_mean']:.0%} ({r['utilisation_min']:.0%}-"
                    f"{r['utilisation_max']:.0%})")

        ratio = (_pct(pull["p99_ms"] / push["p99_ms"]) if pull and push and push["p99_ms"]
                 else "-")
        returned = pull.get("redelivered") if pull else None
        lines.append(markdown.row([
            seed, f"{fraction:.0%}", _ms(pull and pull["p50_ms"]), _ms(pull and pull["p99_ms"]),
            _ms(push and push["p50_ms"]), _ms(push and push["p99_ms"]), ratio, util(pull),
            util(push), "-" if returned is None else returned]))
    lines += ["", f"Median over {len(data.get('seeds') or [1])} seed(s):", "",
              *markdown.table(
                  ["load", "pull p50 ms", "pull p99 ms", "push p50 ms", "push p99 ms",
                   "pull/push p99 (median of seeds)", "pull util", "push util"],
                  [[f"{m['fraction']:.0%}", _ms(m["pull_p50_ms"]), _ms(m["pull_p99_ms"]),
                    _ms(m["push_p50_ms"]), _ms(m["push_p99_ms"]), _pct(m["p99_ratio"]),
                    _pct(m["pull_utilisation_mean"]), _pct(m["push_utilisation_mean"])]
                   for m in data.get("medians") or medians(rows)], align="l" * 8)]
    return lines


def plot_pull_vs_push(path: Path, data: dict[str, Any]) -> Path:
    """p99 and utilisation against load: each seed's points and the median line per side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    rows = data["results"]
    for side, style, color in (("pull", "o-", "tab:blue"), ("push", "s--", "tab:orange")):
        mine = [r for r in rows if _mode(r) == side]
        meds = data.get("medians") or medians(rows)
        loads = [m["fraction"] * 100 for m in meds]
        label = "pull: one shared queue" if side == "pull" else "push: round-robin router"
        left.plot(loads, [m[f"{side}_p99_ms"] for m in meds], style, color=color,
                  label=f"{label} (median)")
        left.scatter([r["fraction"] * 100 for r in mine], [r["p99_ms"] for r in mine],
                     color=color, alpha=0.35, s=14)
        right.plot(loads, [m[f"{side}_utilisation_mean"] * 100 for m in meds], style,
                   color=color, label=side)
        right.scatter([r["fraction"] * 100 for r in mine],
                      [r["utilisation_mean"] * 100 for r in mine], color=color, alpha=0.35, s=14)
    left.set_xlabel("offered load, % of capacity")
    left.set_ylabel("p99 ms (dots: each seed)")
    left.legend(fontsize="small")
    right.set_xlabel("offered load, % of capacity")
    right.set_ylabel("mean device utilisation, %")
    right.legend(fontsize="small")
    seeds = ", ".join(str(s) for s in data.get("seeds") or [])
    env = "".join(f", {k}={v}" for k, v in (data.get("env") or {}).items())
    fig.suptitle(f"SIMULATED: pull vs push, {data['workers']} workers, seeds {seeds}{env} "
                 "(bench.fleet)")
    fig.savefig(path, dpi=80)
    return path


def report(data: dict[str, Any]) -> str:
    lines = ["SIMULATED workers (runtimes/doubles/sim, " + ", ".join(
        f"{k.removeprefix('SHOAL_SIM_COST_').lower()}={v}" for k, v in data["simulated"].items()
        if k.startswith("SHOAL_SIM_COST")) + ")", ""]
    if data["experiment"] == "scaling":
        one = next((r["knee"]["throughput"] for r in data["results"]
                    if r["workers"] == 1 and r["knee"]), None)
        rows = []
        for r in data["results"]:
            k = r["knee"]
            if k is None:
                rows.append([r["workers"], "-", "-", "-", "-", "-"])
                continue
            ratio = f"{k['throughput'] / (one * r['workers']):.0%}" if one else "-"
            rows.append([r["workers"], f"{k['load']:.0f}", f"{k['throughput']:.0f}",
                         f"{k['p50_ms']:.0f}", f"{k['p99_ms']:.0f}", ratio])
        lines += markdown.table(["workers", "knee: clients", "req/s", "p50 ms", "p99 ms",
                                 "vs N x 1 worker"], rows, align="l" * 6)
    else:
        lines += pull_vs_push_report(data)
    return "\n".join(lines)


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
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="worker settings, e.g. SHOAL_BATCH_MAX_TOKENS=2048")
    args = parser.parse_args(argv)
    EXTRA_ENV.update(item.split("=", 1) for item in args.env)
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
