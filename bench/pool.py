"""Many models per device: the pool (any worker loads any model) against fixed partitions.

    .venv/bin/python -m bench.pool --rounds 3 --png docs/bench/pool.png

Twelve catalog models whose operation is `encode` with dense outputs (eleven `dense`
entries and CLIP's text tower), with Zipf(s) popularity (rank 1 the most asked for),
served by two SIMULATED workers (`SHOAL_RUNTIME=sim`: real Celery and RabbitMQ, batches
and loads sleep). Three deployments, each on a fresh private queue prefix, everything
stopped between them:

- pool: both workers may serve all 12 (SHOAL_MODELS = the 12, SHOAL_PIN= none) with a
  budget of 4 models each: a model loads on its first request on whichever worker got
  it and is evicted LRU; consumer priorities steer traffic to workers holding it;
- partition: each worker serves 6 models, pinned, with a budget for 6: everything is
  resident, each model on one worker (what a router-based deployment does when memory
  allows);
- router: the same 6 + 6 split with the 4-model budget and nothing pinned: each worker
  loads and evicts within its own six.

The split gives each worker half of the traffic (`--partition balanced`: of the 924
ways to put 6 of 12 models on each worker, the one whose busier worker gets the least
traffic; with Zipf(1.1) that is ranks 1, 8-12 and ranks 2-7, 50/50), as an operator
who knows the popularity would; `--partition contiguous` puts ranks 1-6 on worker 1 and
7-12 on worker 2 (82/18 of the traffic).

The models' catalog entries are copied into a private catalog folder
(SHOAL_CATALOG_DIR) with one `cpu` profile for all twelve: a batch sleeps
a + b*T (T padded tokens; `--cost-a-ms`, `--cost-b-us`), a load sleeps `--load-ms` and
takes `--footprint-mib`, all divided by `--sim-speed` except the footprint. The
budget is `--slots` (or `--partition-slots`) footprints plus 10% of one.

The client publishes shoal task messages itself (the gateway's own `Broker` class, so
the gateway's CPU does not blur the fleet) at Poisson arrival times, `--rate` per
second, each request for a model drawn by popularity, carrying 1-4 texts of 5-15
words. Every deployment of a round gets the same arrival times, models and texts
(the round's seed). Counted over the window after `--warmup` s: requests scheduled
in it (latency from the scheduled send to the reply, per popularity tier: head =
ranks 1-2, torso = 3-6, tail = 7-12), errors, successes completed in it (req/s),
each worker's simulated busy time over the window (utilisation), and loads and
evictions per minute from the workers' Prometheus counters
(shoal_model_loads_total{outcome="ok"}, shoal_model_evictions_total), read at the
window's start and end. Every line of output says SIMULATED.

`--real` runs the same experiment on real workers (the pytorch runtime, one torch
thread each) serving twelve tiny random BERT sentence encoders built at run time
under the twelve ids (nothing downloaded): real loads, real footprints (the budget is
`--slots` of the measured weight files), real batches. Lines then say REAL (tiny
models) instead; on this 2-core machine use a lower `--rate`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from app.tuning import markdown
from app.tuning.inproc import machine_info
from app.tuning.mix import make_requests
from app.tuning.stack import Stack, delete_queues, free_port, prefix_queues, queue_counts, wait_for
from app.tuning.stats import median, percentile
from bench.lib.output import emit
from gateway.broker.link import Broker
from tasks.catalog import load_catalog
from tasks.envelope import task_part
from tasks.errors import ShoalError
from tasks.served import read_served
from tasks.settings import PACKAGED_CATALOG_DIR, Settings, get_settings
from tasks.topology import queue_for

# Twelve models the sim serves with one operation (encode, dense vectors), most popular
# first by default; `--models` picks others.
MODELS = (
    "sentence-transformers/all-MiniLM-L6-v2",
    "BAAI/bge-small-en-v1.5",
    "intfloat/e5-small-v2",
    "thenlper/gte-small",
    "Snowflake/snowflake-arctic-embed-s",
    "intfloat/multilingual-e5-small",
    "sentence-transformers/paraphrase-multilingual-MiniLM-L12-v2",
    "sentence-transformers/all-mpnet-base-v2",
    "BAAI/bge-base-en-v1.5",
    "mixedbread-ai/mxbai-embed-large-v1",
    "BAAI/bge-m3",
    "openai/clip-vit-base-patch32",
)
# Popularity tiers by rank (1-based, inclusive).
TIERS = (("head", 1, 2), ("torso", 3, 6), ("tail", 7, 12))
DEPLOYMENTS = ("pool", "partition", "router")
WORKERS = 2
MIB = 2**20


# --- pure helpers ---------------------------------------------------------------------------


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 1..n under Zipf(s): proportional to 1/k^s, summing to 1."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not (s >= 0 and math.isfinite(s)):
        raise ValueError(f"s must be a finite number >= 0, got {s}")
    raw = [1 / k**s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def tier_of(rank: int, tiers: Sequence[tuple[str, int, int]] = TIERS) -> str:
    """The tier of a 1-based popularity rank."""
    for name, first, last in tiers:
        if first <= rank <= last:
            return name
    raise ValueError(f"rank {rank} is in no tier of {tiers}")


def tier_shares(weights: Sequence[float],
                tiers: Sequence[tuple[str, int, int]] = TIERS) -> dict[str, float]:
    """The share of the traffic each tier gets."""
    return {name: sum(weights[first - 1:last]) for name, first, last in tiers}


def split_models(weights: Sequence[float], mode: str = "balanced") -> tuple[list[int], list[int]]:
    """Two equal halves of the ranks (0-based indices): `contiguous` (the first half, the
    rest), or `balanced`: the halves whose busier one gets the least traffic (exhaustive;
    ties: the first found, which holds index 0)."""
    n = len(weights)
    if n < 2 or n % 2:
        raise ValueError(f"an even number of models >= 2 is needed, got {n}")
    everything = list(range(n))
    if mode == "contiguous":
        return everything[:n // 2], everything[n // 2:]
    if mode != "balanced":
        raise ValueError(f"mode must be 'balanced' or 'contiguous', got {mode!r}")
    total = sum(weights)
    best: tuple[float, list[int]] | None = None
    for rest in itertools.combinations(everything[1:], n // 2 - 1):
        first = [0, *rest]
        share = sum(weights[i] for i in first)
        worst = max(share, total - share)
        if best is None or worst < best[0] - 1e-12:
            best = (worst, first)
    assert best is not None
    first = best[1]
    return first, [i for i in everything if i not in first]


def parse_counters(text: str, names: Sequence[str]) -> dict[tuple[str, tuple], float]:
    """Samples of the Prometheus counters `names` in an exposition text: {(name, sorted
    label pairs): value} (the `_total` samples, not `_created`)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def counter_delta(before: dict[tuple[str, tuple], float], after: dict[tuple[str, tuple], float],
                  name: str, **labels: str) -> float:
    """How much the samples of `name` whose labels include `labels` grew."""
    total = 0.0
    for key, value in after.items():
        sample, pairs = key
        if sample != name or any(dict(pairs).get(k) != v for k, v in labels.items()):
            continue
        total += value - before.get(key, 0.0)
    return total


def schedule(rounds: int, names: Sequence[str] = DEPLOYMENTS) -> list[tuple[int, str]]:
    """(round, deployment) in running order: each round rotates the order by one, so no
    deployment always runs first (after the machine idled) or last."""
    out = []
    for r in range(rounds):
        shift = r % len(names)
        out += [(r, name) for name in [*names[shift:], *names[:shift]]]
    return out


# --- the deployments -------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    models: tuple[str, ...]
    pin: tuple[str, ...]
    budget_bytes: int


@dataclass(frozen=True)
class Deployment:
    name: str
    what: str
    workers: tuple[WorkerSpec, ...]


def deployments(models: Sequence[str], halves: tuple[list[int], list[int]], footprint: int,
                slots: int, partition_slots: int) -> dict[str, Deployment]:
    slack = footprint // 10
    small = slots * footprint + slack
    big = partition_slots * footprint + slack
    everything = tuple(models)
    parts = [tuple(models[i] for i in half) for half in halves]
    return {
        "pool": Deployment("pool", f"pool: every worker may load any of the {len(models)}, "
                           f"budget {slots} models",
                           tuple(WorkerSpec(everything, (), small) for _ in range(WORKERS))),
        "partition": Deployment("partition", f"static partition: {len(parts[0])} pinned per "
                                f"worker, budget {partition_slots} models",
                                tuple(WorkerSpec(p, p, big) for p in parts)),
        "router": Deployment("router", f"router: {len(parts[0])} per worker, budget {slots} "
                             "models, load/evict within them",
                             tuple(WorkerSpec(p, (), small) for p in parts)),
    }


def write_catalog(directory: Path, models: Sequence[str], profile: dict[str, Any]) -> None:
    """Copies of the packaged entries of `models` whose only profile is `profile` (cpu)."""
    origins = load_catalog(PACKAGED_CATALOG_DIR)._origins
    for model in models:
        raw = yaml.safe_load(origins[model].read_text(encoding="utf-8"))
        raw["profiles"] = {"cpu": dict(profile)}
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", model).lower()
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False),
                                                encoding="utf-8")


@dataclass
class Fleet:
    prefix: str
    worker_names: list[str]
    metrics_urls: list[str]
    log_dir: Path
    stack: Stack


def write_real_catalog(directory: Path, models: Sequence[str],
                       profile: dict[str, Any]) -> int:
    """Entries for `models` served by tiny random sentence encoders built here (a seed
    each); the bytes of one model's weight files."""
    from runtimes.model_files.footprint import estimate_bytes
    from tests.tiny_models import build_tiny_sentence_transformer

    weights = directory / "weights"
    weights.mkdir()
    size = 0
    for i, model in enumerate(models):
        path = build_tiny_sentence_transformer(weights / f"m{i}", pooling="mean",
                                               normalize=True, seed=i)
        size = max(size, estimate_bytes(path))
        entry = {"id": model, "adapter": "dense", "dims": 32, "source": {"path": str(path)},
                 "profiles": {"cpu": dict(profile)}}
        (directory / f"m{i}.yaml").write_text(yaml.safe_dump(entry, sort_keys=False),
                                               encoding="utf-8")
    return size


@contextlib.contextmanager
def fleet(deployment: Deployment, catalog_dir: Path, sim_speed: float,
          log_root: Path, real: bool = False) -> Iterator[Fleet]:
    """The deployment's workers on a fresh queue prefix, stopped (and its queues deleted)
    on exit; ready once every model queue has its consumers."""
    prefix = f"shoal-pool-{deployment.name}-{uuid.uuid4().hex[:6]}"
    log_dir = log_root / prefix
    log_dir.mkdir(parents=True)
    env = {**os.environ, "SHOAL_QUEUE_PREFIX": prefix,
           "SHOAL_RUNTIME": "pytorch" if real else "sim", "SHOAL_TORCH_THREADS": "1",
           "SHOAL_CATALOG_DIR": str(catalog_dir), "SHOAL_SIM_SPEED": f"{sim_speed:g}"}
    for name in [k for k in env if k.startswith("SHOAL_SIM_COST_")]:
        del env[name]  # the catalog's profile decides
    broker_url = env.get("SHOAL_BROKER_URL") or get_settings().broker_url
    stack = Stack(env, log_dir)
    models = sorted({m for w in deployment.workers for m in w.models})
    try:
        names, urls = [], []
        for i, spec in enumerate(deployment.workers):
            port = free_port()
            name = f"{prefix}-w{i}"
            stack.worker(name, list(spec.models), log_level="info",
                         SHOAL_PIN=",".join(spec.pin),
                         SHOAL_DEVICE_MEMORY_BYTES=str(spec.budget_bytes),
                         SHOAL_WORKER_METRICS_PORT=str(port))
            names.append(name)
            urls.append(f"http://127.0.0.1:{port}/metrics")
        settings = Settings(queue_prefix=prefix)
        for model in models:
            want = sum(model in w.models for w in deployment.workers)
            queue = queue_for(model, settings).name
            wait_for(lambda q=queue, n=want: queue_counts(q, broker_url)[1] >= n, 120,
                     f"{want} consumer(s) of {queue}", interval=0.2, give_up=stack.exited)
        for url in urls:
            wait_for(lambda u=url: _get(u), 30, f"the worker metrics at {url}", interval=0.2)
        yield Fleet(prefix, names, urls, log_dir, stack)
    finally:
        stack.stop_all(timeout=30)
        delete_queues(prefix_queues(prefix, models), broker_url)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


COUNTERS = ("shoal_model_loads_total", "shoal_model_evictions_total")


async def scrape(urls: Sequence[str]) -> list[dict[tuple[str, tuple], float]]:
    texts = await asyncio.gather(*(asyncio.to_thread(_get, u) for u in urls))
    return [parse_counters(t, COUNTERS) for t in texts]


# --- the load -------------------------------------------------------------------------------


@dataclass
class Outcome:
    rank: int  # 1-based popularity rank
    sent: float  # scheduled send, perf_counter seconds
    done: float
    ok: bool
    error: str | None = None
    worker: str | None = None
    queue_ms: float | None = None
    busy_ms: float = 0.0  # its share of its batch's simulated device time
    message: str | None = None  # an error's text
    wall: float = 0.0  # time.time() of the reply, to find it in the workers' logs


class Client:
    """Publishes shoal task messages for any of the models and awaits the replies."""

    def __init__(self, prefix: str, models: Sequence[str], catalog_dir: Path) -> None:
        self.models = list(models)
        self.broker = Broker(Settings(queue_prefix=prefix, models=self.models), self.models)
        catalog = load_catalog(catalog_dir)
        self.entries = dict(zip(self.models, catalog.require(self.models), strict=True))

    async def start(self) -> None:
        self.broker.start()
        deadline = time.monotonic() + 30
        while not self.broker.ready:
            if time.monotonic() > deadline:
                raise TimeoutError("the broker connection did not come up")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.broker.close()

    async def call(self, rank: int, texts: list[str], scheduled: float,
                   timeout_s: float) -> Outcome:
        model = self.models[rank - 1]
        kwargs = {"model": model, "items": [{"text": t} for t in texts]}
        part = task_part(self.entries[model], kwargs, int(timeout_s * 1000))
        try:
            reply = await self.broker.submit(model, part, timeout_s)
        except Exception as exc:
            code = getattr(exc, "code", None)
            return Outcome(rank, scheduled, time.perf_counter(), False,
                           str(code) if code else type(exc).__name__, message=str(exc))
        done = time.perf_counter()
        result = reply.get("result")
        if reply.get("status") != "SUCCESS":
            error = ShoalError.from_celery_failure(result)
            return Outcome(rank, scheduled, done, False, str(error.code),
                           message=error.message, wall=time.time())
        served = read_served(result if isinstance(result, dict) else {})
        batch = served.batch or {}
        queue_ms = (served.timing or {}).get("queue_ms")
        busy = float(batch.get("inference_ms", 0.0)) / max(1, int(batch.get("requests", 1)))
        return Outcome(rank, scheduled, done, True, None, served.worker,
                       None if queue_ms is None else float(queue_ms), busy)


@dataclass
class Plan:
    """One round's arrivals: offsets from the start (s), ranks and texts."""

    offsets: list[float]
    ranks: list[int]
    texts: list[list[str]]


def make_plan(rate: float, seconds: float, weights: Sequence[float], seed: int,
              items: str = "uniform:1:4", words: str = "uniform:5:15") -> Plan:
    """Poisson arrivals at `rate` per second over `seconds`, each for a model drawn by
    `weights` (rank = index + 1), with its texts; the same seed gives the same plan."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be > 0, got {rate}")
    arrivals = random.Random(f"{seed}/arrivals")
    picks = random.Random(f"{seed}/models")
    offsets, at = [], 0.0
    while (at := at + arrivals.expovariate(rate)) < seconds:
        offsets.append(at)
    ranks = [r + 1 for r in picks.choices(range(len(weights)), weights, k=len(offsets))]
    pool = make_requests(max(1, min(len(offsets), 4000)), items, words, seed=seed)
    return Plan(offsets, ranks, [pool[i % len(pool)] for i in range(len(offsets))])


@dataclass
class Window:
    outcomes: list[Outcome] = field(default_factory=list)  # scheduled inside the window
    outside: list[Outcome] = field(default_factory=list)  # scheduled before it
    before: list[dict] = field(default_factory=list)
    after: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    start: float = 0.0  # perf_counter seconds
    end: float = 0.0


async def drive(client: Client, plan: Plan, warmup: float, duration: float,
                urls: Sequence[str], timeout_s: float) -> Window:
    """Send the plan (its offsets from now); outcomes of requests scheduled after `warmup`,
    and the worker counters at the window's start and end."""
    start = time.perf_counter()
    window = Window(seconds=duration, start=start + warmup, end=start + warmup + duration)
    tasks: set[asyncio.Task] = set()

    async def one(rank: int, texts: list[str], scheduled: float) -> None:
        outcome = await client.call(rank, texts, scheduled, timeout_s)
        inside = window.start <= scheduled < window.end
        (window.outcomes if inside else window.outside).append(outcome)

    async def edge(at: float, into: list) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        into.extend(await scrape(urls))

    meters = [asyncio.create_task(edge(window.start, window.before)),
              asyncio.create_task(edge(window.end, window.after))]
    for offset, rank, texts in zip(plan.offsets, plan.ranks, plan.texts, strict=True):
        at = start + offset
        if at >= window.end:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        task = asyncio.create_task(one(rank, texts, at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*meters)
    if tasks:
        await asyncio.gather(*tasks)
    return window


def summarize(window: Window, worker_names: Sequence[str], weights: Sequence[float]) -> dict:
    """One deployment's row: throughput, latency per tier, errors, loads, evictions."""
    duration = window.seconds
    outcomes = window.outcomes
    ok = [o for o in outcomes if o.ok]
    completed = [o for o in [*outcomes, *window.outside]
                 if o.ok and window.start <= o.done < window.end]
    row: dict[str, Any] = {
        "scheduled": len(outcomes), "ok": len(ok), "errors": len(outcomes) - len(ok),
        "error_rate": (len(outcomes) - len(ok)) / len(outcomes) if outcomes else None,
        "error_kinds": dict(Counter(o.error for o in outcomes if not o.ok)),
        "errors_by_rank": dict(sorted(Counter(o.rank for o in outcomes if not o.ok).items())),
        # The commonest error texts, numbers and model ids blurred so that alike ones count
        # together.
        "error_messages": dict(Counter(_blur(o.message) for o in outcomes
                                       if not o.ok).most_common(8)),
        # The first few errors other than the commonest kind, with their wall-clock time.
        "rare_errors": [{"rank": o.rank, "code": o.error, "message": o.message,
                         "at": time.strftime("%H:%M:%S", time.localtime(o.wall))
                         + f".{int(o.wall % 1 * 1000):03d}"}
                        for o in [o for o in outcomes if not o.ok and o.error != _commonest(
                            outcomes)][:20]],
        "req_per_s": len(completed) / duration,
        "p50_ms": percentile([(o.done - o.sent) * 1000 for o in ok], 50),
        "p99_ms": percentile([(o.done - o.sent) * 1000 for o in ok], 99),
    }
    for name, first, last in TIERS:
        mine = [(o.done - o.sent) * 1000 for o in ok if first <= o.rank <= last]
        failed = sum(1 for o in outcomes if not o.ok and first <= o.rank <= last)
        row[name] = {"requests": len(mine), "p50_ms": percentile(mine, 50),
                     "p99_ms": percentile(mine, 99), "errors": failed,
                     "error_rate": failed / (failed + len(mine)) if failed + len(mine) else None}
    # Who served what: per worker, its requests by rank, and its simulated busy share.
    by_worker: dict[str, Counter] = {}
    busy: dict[str, float] = {}
    for o in completed:
        key = _worker_index(o.worker, worker_names)
        by_worker.setdefault(key, Counter())[o.rank] += 1
        busy[key] = busy.get(key, 0.0) + o.busy_ms
    row["utilisation"] = {k: busy.get(k, 0.0) / (duration * 1000)
                          for k in (f"w{i}" for i in range(len(worker_names)))}
    row["utilisation_mean"] = statistics.fmean(row["utilisation"].values())
    row["served_by"] = {k: dict(sorted(v.items())) for k, v in sorted(by_worker.items())}
    row["traffic_share"] = {k: sum(v.values()) / max(1, len(completed))
                            for k, v in sorted(by_worker.items())}
    # Ranks that both workers served (each at least 5% of the rank's requests).
    counts = {rank: [by_worker.get(f"w{i}", Counter())[rank] for i in range(len(worker_names))]
              for rank in range(1, len(weights) + 1)}
    row["ranks_on_both"] = [r for r, c in counts.items()
                            if sum(c) and min(c) >= 0.05 * sum(c)]
    minutes = duration / 60
    loads = [counter_delta(b, a, "shoal_model_loads_total", outcome="ok")
             for b, a in zip(window.before, window.after, strict=True)]
    failed = [counter_delta(b, a, "shoal_model_loads_total") - ok_loads
              for b, a, ok_loads in zip(window.before, window.after, loads, strict=True)]
    evictions = [counter_delta(b, a, "shoal_model_evictions_total")
                 for b, a in zip(window.before, window.after, strict=True)]
    row["loads_per_min"] = sum(loads) / minutes
    row["loads_per_min_by_worker"] = [v / minutes for v in loads]
    row["failed_loads"] = sum(failed)
    row["evictions_per_min"] = sum(evictions) / minutes
    row["evictions_per_min_by_worker"] = [v / minutes for v in evictions]
    queued = [o.queue_ms for o in ok if o.queue_ms is not None]
    row["queue_ms_p99"] = percentile(queued, 99)
    return row


def _commonest(outcomes: Sequence[Outcome]) -> str | None:
    kinds = Counter(o.error for o in outcomes if not o.ok).most_common(1)
    return kinds[0][0] if kinds else None


def _blur(message: str | None) -> str:
    text = re.sub(r"\d+(\.\d+)?", "N", message or "")
    return re.sub(r"[\w.-]+/[\w.-]+", "MODEL", text)[:300]


def _worker_index(worker: str | None, names: Sequence[str]) -> str:
    for i, name in enumerate(names):
        if worker and worker.startswith(f"{name}@"):
            return f"w{i}"
    return "?"


LOG_LINE = re.compile(r"\[(?P<when>[^\]]+?)(?:,\d+)?: \w+/\w+\] (?P<what>(?:loading|loaded|"
                      r"evicting) .*)$")


def log_events(log_text: str) -> dict[str, Any]:
    """Counts of a worker log's pool events (loads started, loads ended, evictions) and
    its tracebacks and errors."""
    starts = Counter()
    evicted = Counter()
    for line in log_text.splitlines():
        match = LOG_LINE.search(line)
        if not match:
            continue
        words = match.group("what").split()
        if words[0] == "loading":
            starts[words[1]] += 1
        elif words[0] == "evicting":
            evicted[words[1]] += 1
    return {"loads_started": sum(starts.values()), "evictions": sum(evicted.values()),
            "loads_by_model": dict(starts), "evictions_by_model": dict(evicted),
            "tracebacks": log_text.count("Traceback"),
            "errors": sum(1 for line in log_text.splitlines()
                          if "ERROR/" in line or "CRITICAL/" in line)}


# --- the experiment --------------------------------------------------------------------------


async def run_one(deployment: Deployment, plan: Plan, args: argparse.Namespace,
                  catalog_dir: Path, log_root: Path, models: Sequence[str],
                  weights: Sequence[float]) -> dict[str, Any]:
    started = time.perf_counter()
    with fleet(deployment, catalog_dir, args.sim_speed, log_root, args.real) as f:
        client = Client(f.prefix, models, catalog_dir)
        await client.start()
        try:
            window = await drive(client, plan, args.warmup, args.duration, f.metrics_urls,
                                 args.timeout)
        finally:
            await client.close()
        row = summarize(window, f.worker_names, weights)
        logs = {name: log_events((f.log_dir / f"{name}.log").read_text(errors="replace"))
                for name in f.worker_names}
    row["worker_logs"] = {f"w{i}": logs[name] for i, name in enumerate(f.worker_names)}
    row["log_dir"] = str(f.log_dir)
    row["seconds"] = time.perf_counter() - started
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    models = list(args.models)
    weights = zipf_weights(len(models), args.zipf_s)
    halves = split_models(weights, args.partition)
    footprint = int(args.footprint_mib * MIB)
    profile = {"max_tokens": 4096, "max_items": 64, "cost_a_ms": args.cost_a_ms,
               "cost_b_us": args.cost_b_us, "cost_c_ns": 0.0, "load_ms": args.load_ms,
               "footprint_bytes": footprint,
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
    plans = deployments(models, halves, footprint, args.slots, args.partition_slots)
    kind = "REAL (tiny models)" if args.real else "SIMULATED"
    order = schedule(args.rounds, args.deployments)
    rows: list[dict[str, Any]] = []
    began = time.perf_counter()
    try:
        with tqdm(total=len(order), unit="run", desc=f"bench.pool [{kind}]",
                  file=sys.stderr) as bar:
            for r, name in order:
                seed = args.seed + r
                plan = make_plan(args.rate, args.warmup + args.duration, weights, seed)
                bar.set_postfix_str(f"round {r + 1} {name}")
                row = asyncio.run(run_one(plans[name], plan, args, catalog_dir, log_root,
                                          models, weights))
                row.update(round=r + 1, seed=seed, deployment=name)
                rows.append(row)
                bar.write(f"  round {r + 1} {name}: {row['req_per_s']:.1f} req/s, p99 head "
                          f"{_ms(row['head']['p99_ms'])} torso {_ms(row['torso']['p99_ms'])} "
                          f"tail {_ms(row['tail']['p99_ms'])} ms, errors {row['errors']}, "
                          f"loads {row['loads_per_min']:.0f}/min, evictions "
                          f"{row['evictions_per_min']:.0f}/min, utilisation "
                          f"{row['utilisation_mean']:.0%} [{kind}]")
                bar.update()
    finally:
        shutil.rmtree(catalog_dir, ignore_errors=True)
    return {
        "experiment": "pool", "simulated": not args.real, "models": models,
        "weights": weights, "tier_shares": tier_shares(weights),
        "halves": [[models[i] for i in h] for h in halves],
        "halves_share": [sum(weights[i] for i in h) for h in halves],
        "deployments": {k: asdict(v) for k, v in plans.items() if k in args.deployments},
        "profile": profile, "sim_speed": args.sim_speed, "rate": args.rate,
        "slots": args.slots, "partition_slots": args.partition_slots, "zipf_s": args.zipf_s,
        "rows": rows, "medians": medians(rows), "ratios": ratios(rows),
        "log_root": str(log_root), "seconds": time.perf_counter() - began,
    }


# --- reporting -------------------------------------------------------------------------------

METRICS = ("req_per_s", "errors", "error_rate", "utilisation_mean", "loads_per_min",
           "evictions_per_min", "p99_ms")


def _value(row: dict[str, Any], key: str) -> float | None:
    if "." in key:
        tier, metric = key.split(".")
        return row[tier][metric]
    return row[key]


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per deployment, the median over rounds of each number in the table."""
    keys = [*METRICS, *(f"{t}.{m}" for t, _, _ in TIERS
                        for m in ("p50_ms", "p99_ms", "error_rate"))]
    out = {}
    for name in dict.fromkeys(r["deployment"] for r in rows):
        mine = [r for r in rows if r["deployment"] == name]
        out[name] = {k: median([_value(r, k) for r in mine]) for k in keys}
        out[name]["rounds"] = len(mine)
    return out


def ratios(rows: list[dict[str, Any]], base: str = "partition") -> dict[str, dict[str, Any]]:
    """p99 per tier of each deployment over `base`'s in the same round: every round's and
    their median."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["deployment"] for r in rows):
        if name == base:
            continue
        per: dict[str, list[float]] = {t: [] for t, _, _ in TIERS}
        for row in (r for r in rows if r["deployment"] == name):
            other = next((r for r in rows if r["deployment"] == base
                          and r["round"] == row["round"]), None)
            for tier, _, _ in TIERS:
                if other and row[tier]["p99_ms"] and other[tier]["p99_ms"]:
                    per[tier].append(row[tier]["p99_ms"] / other[tier]["p99_ms"])
        out[name] = {t: {"rounds": v, "median": median(v)} for t, v in per.items()}
    return out


_ms = partial(markdown.dash, spec=".0f")


_pct = partial(markdown.dash, spec=".0%")


def table(data: dict[str, Any]) -> str:
    rows, meds = data["rows"], data["medians"]
    shares = data["tier_shares"]
    p = data["profile"]
    head = ["req/s", "errors", *(f"{t} p50 / p99 ms (errors)" for t, _, _ in TIERS),
            "loads/min", "evictions/min", "device util"]
    kind, workers = (("SIMULATED", "sim") if data.get("simulated", True)
                     else ("REAL (tiny models; batch and load constants are seeds)", "real"))
    lines = [
        f"{kind}: {len(data['models'])} models, Zipf popularity (tiers: " + ", ".join(
            f"{t} {shares[t]:.0%}" for t, _, _ in TIERS) + f"), {WORKERS} {workers} workers, "
        f"{data['rate']:g} req/s Poisson; batch {p['cost_a_ms']:g} ms + "
        f"{p['cost_b_us']:g} us/token, load {p['load_ms']:g} ms, footprint "
        f"{p['footprint_bytes'] / MIB:g} MiB, sim speed x{data['sim_speed']:g}; split "
        + " / ".join(f"{s:.0%}" for s in data["halves_share"]), "",
        *markdown.table(["deployment", "round", *head], align="l" * (len(head) + 2))]

    def get(r: dict[str, Any], key: str) -> Any:
        return _value(r, key) if key.split(".")[0] in r else r.get(key)

    def line(cells: list[str], r: dict[str, Any]) -> str:
        util = r["utilisation_mean"]
        return markdown.row([
            *cells, f"{r['req_per_s']:.1f}", _pct(r["error_rate"]),
            *(f"{_ms(get(r, f'{t}.p50_ms'))} / {_ms(get(r, f'{t}.p99_ms'))} "
              f"({_pct(get(r, f'{t}.error_rate'))})" for t, _, _ in TIERS),
            f"{r['loads_per_min']:.1f}", f"{r['evictions_per_min']:.1f}", _pct(util)])

    for row in sorted(rows, key=lambda r: (DEPLOYMENTS.index(r["deployment"]), r["round"])):
        lines.append(line([row["deployment"], str(row["round"])], row))
    lines += ["", f"Median over rounds ({max((m['rounds'] for m in meds.values()), default=0)}):",
              "", *markdown.table(["deployment", *head], align="l" * (len(head) + 1))]
    for name in (n for n in DEPLOYMENTS if n in meds):
        lines.append(line([name], meds[name]))
    if data["ratios"]:
        lines += ["", "p99 over the static partition's, same round (rounds; median):", ""]
        ratio_rows = []
        for name, per in data["ratios"].items():
            cells = [name]
            for tier, _, _ in TIERS:
                v = per[tier]
                each = ", ".join(f"{x:.2f}" for x in v["rounds"])
                cells.append("-" if v["median"] is None else f"{each}; **{v['median']:.2f}**")
            ratio_rows.append(cells)
        lines += markdown.table(["deployment", "head", "torso", "tail"], ratio_rows,
                                align="llll")
    return "\n".join(lines)


def plot(path: Path, data: dict[str, Any]) -> Path:
    """Per popularity tier and deployment: p50, p99 (bars: medians over rounds, dots: each
    round) and the share of errors; and loads and evictions per minute."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).flatten()
    names = [n for n in DEPLOYMENTS if n in data["medians"]]
    colors = {"pool": "tab:blue", "partition": "tab:orange", "router": "tab:green"}
    width = 0.8 / max(1, len(names))
    tiers = [t for t, _, _ in TIERS]
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    panels = (("p50_ms", "p50 latency, ms (log)", True),
              ("p99_ms", "p99 latency, ms (log)", True),
              ("error_rate", "errors, % of requests", False))
    for axis, (metric, label, log) in zip(axes[:3], panels, strict=True):
        scale = 1 if log else 100
        for k, name in enumerate(names):
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(tiers))]
            values = [(data["medians"][name][f"{t}.{metric}"] or 0) * scale for t in tiers]
            axis.bar(xs, values, width=width, color=colors.get(name), label=name)
            for i, tier in enumerate(tiers):
                dots = [r[tier][metric] * scale for r in data["rows"]
                        if r["deployment"] == name and r[tier][metric] is not None]
                axis.scatter([xs[i]] * len(dots), dots, color="black", s=8, zorder=3)
        axis.set_xticks(range(len(tiers)), [f"{t}\n{data['tier_shares'][t]:.0%} of requests"
                                            for t in tiers])
        if log:
            axis.set_yscale("log")
            axis.set_ylim(bottom=10)
            axis.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
            axis.yaxis.set_major_formatter(plain)
            axis.yaxis.set_minor_formatter(NullFormatter())
        else:  # a share: from 0 (with no errors at all, matplotlib centres the axis on 0)
            axis.set_ylim(0, max(5.0, axis.get_ylim()[1]))
        axis.set_ylabel(label)
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize="small")
    axis = axes[3]
    for j, (metric, label) in enumerate((("loads_per_min", "loads"),
                                         ("evictions_per_min", "evictions"))):
        xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
        axis.bar(xs, [data["medians"][n][metric] or 0 for n in names], width=0.38,
                 color=["tab:purple", "tab:gray"][j], label=label)
    axis.set_xticks(range(len(names)), names)
    axis.set_ylabel("per minute, both workers")
    axis.legend(fontsize="small")
    p = data["profile"]
    rounds = max(m["rounds"] for m in data["medians"].values())
    load_ms = p["load_ms"] / data["sim_speed"]
    kind = "SIMULATED" if data.get("simulated", True) else "REAL (tiny models)"
    fig.suptitle(f"{kind}: {len(data['models'])} models (Zipf {data['zipf_s']:g}), 2 workers, "
                 f"budget {data['slots']} models, {data['rate']:g} req/s, load {load_ms:g} ms\n"
                 f"(bench.pool; bars: medians of {rounds} rounds, dots: each round)",
                 color="tab:red")
    fig.savefig(path, dpi=80)
    return path


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3,
                        help="each round runs every deployment with one seed")
    parser.add_argument("--seed", type=int, default=1, help="of round 1 (round r: seed + r - 1)")
    parser.add_argument("--rate", type=float, default=70.0, help="Poisson arrivals per second")
    parser.add_argument("--duration", type=float, default=25.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="seconds of load before the window (the pools fill)")
    parser.add_argument("--timeout", type=float, default=30.0, help="each request's deadline, s")
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--models", type=_models, default=list(MODELS),
                        help="12 comma-separated catalog ids (encode), most popular first")
    parser.add_argument("--partition", choices=["balanced", "contiguous"], default="balanced",
                        help="how partition and router split the models between the workers")
    parser.add_argument("--deployments", type=_deployments, default=list(DEPLOYMENTS),
                        help="comma-separated, of " + ", ".join(DEPLOYMENTS))
    parser.add_argument("--slots", type=int, default=4,
                        help="models per worker's budget (pool, router)")
    parser.add_argument("--partition-slots", type=int, default=6,
                        help="models per worker's budget (partition)")
    parser.add_argument("--footprint-mib", type=float, default=100.0)
    parser.add_argument("--load-ms", type=float, default=2000.0)
    parser.add_argument("--cost-a-ms", type=float, default=10.0, help="sim: ms per batch")
    parser.add_argument("--cost-b-us", type=float, default=200.0,
                        help="sim: us per padded token")
    parser.add_argument("--sim-speed", type=float, default=1.0,
                        help="SHOAL_SIM_SPEED: divides batch and load times")
    parser.add_argument("--real", action="store_true",
                        help="real workers and tiny real models instead of the sim")
    parser.add_argument("--log-dir", type=Path,
                        help="keep the workers' logs here (default: a temporary folder)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path, help="e.g. docs/bench/pool.png")
    args = parser.parse_args(argv)
    data = run(args)
    data.update(machine=machine_info(), command=" ".join(["python -m bench.pool", *(
        argv if argv is not None else sys.argv[1:])]))
    print(f"worker logs: {data['log_root']}; {data['seconds']:.0f} s", file=sys.stderr)
    if args.png:
        plot(args.png, data)
    return emit(table(data), data, args.json)


if __name__ == "__main__":
    sys.exit(main())
