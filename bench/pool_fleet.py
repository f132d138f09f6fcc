"""bench.pool's deployments and the client that drives them: the workers' specs, the private
catalog, a fleet's processes on fresh queue prefixes, the clients (one queue prefix, or one
per `mux` replica behind the client-side router) and the open-loop driver."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.tuning.stack import Stack, delete_queues, free_port, prefix_queues, queue_counts, wait_for
from bench.pool_mux import MuxRouter
from bench.pool_stats import COUNTERS, parse_counters
from bench.pool_traffic import Plan
from gateway.broker.link import Broker
from tasks.catalog import load_catalog
from tasks.envelope import task_part
from tasks.errors import ShoalError
from tasks.served import read_served
from tasks.settings import PACKAGED_CATALOG_DIR, Settings, get_settings
from tasks.topology import queue_for

MIB = 2**20


@dataclass(frozen=True)
class WorkerSpec:
    models: tuple[str, ...]
    pin: tuple[str, ...]
    budget_bytes: int
    placement: str = "lru"  # SHOAL_PLACEMENT
    host_bytes: int = 0  # SHOAL_HOST_MEMORY_BYTES (0: no host tier)


@dataclass(frozen=True)
class Deployment:
    name: str
    what: str
    workers: tuple[WorkerSpec, ...]
    own_queues: bool = False  # each worker on its own queue prefix (mux replicas)
    slots: int = 0  # the mux router's mirror: models per replica


def deployments(models: Sequence[str], halves: tuple[list[int], list[int]], footprint: int,
                slots: int, partition_slots: int, workers: int = 2) -> dict[str, Deployment]:
    """Every deployment bench.pool knows, with `workers` workers (router and partition:
    two, one per half)."""
    slack = footprint // 10
    small = slots * footprint + slack
    big = partition_slots * footprint + slack
    host_all = len(models) * footprint + slack
    everything = tuple(models)
    parts = [tuple(models[i] for i in half) for half in halves]
    n = len(models)

    def every(placement: str, host: int) -> tuple[WorkerSpec, ...]:
        return tuple(WorkerSpec(everything, (), small, placement, host) for _ in range(workers))

    return {
        "pool": Deployment("pool", f"pool (fleet placement, host tier): any worker may load "
                           f"any of the {n}, budget {slots} models", every("fleet", host_all)),
        "pool-nohost": Deployment("pool-nohost", f"pool (fleet placement, no host tier): any "
                                  f"worker may load any of the {n}, budget {slots} models",
                                  every("fleet", 0)),
        "pool-lru": Deployment("pool-lru", f"pool (lru, no host tier): any worker may load "
                               f"any of the {n}, budget {slots} models", every("lru", 0)),
        "mux": Deployment("mux", f"multiplexing router: {workers} replicas (own queues, lru, "
                          f"no host tier), budget {slots} models", every("lru", 0),
                          own_queues=True, slots=slots),
        "mux-host": Deployment("mux-host", f"multiplexing router with the host tier: "
                               f"{workers} replicas, budget {slots} models",
                               every("lru", host_all), own_queues=True, slots=slots),
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


@dataclass
class Fleet:
    prefixes: list[str]  # the client's queue prefixes: one, or one per mux replica
    worker_names: list[str]
    metrics_urls: list[str]
    pids: list[int]
    log_dir: Path
    stack: Stack


@contextlib.contextmanager
def fleet(deployment: Deployment, catalog_dir: Path, sim_speed: float,
          log_root: Path, real: bool = False) -> Iterator[Fleet]:
    """The deployment's workers on a fresh queue prefix (a mux replica: each its own),
    stopped (and its queues deleted) on exit; ready once every model queue has its
    consumers."""
    prefix = f"shoal-pool-{deployment.name}-{uuid.uuid4().hex[:6]}"
    prefixes = ([f"{prefix}-r{i}" for i in range(len(deployment.workers))]
                if deployment.own_queues else [prefix] * len(deployment.workers))
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
        names, urls, pids = [], [], []
        for i, spec in enumerate(deployment.workers):
            port = free_port()
            name = f"{prefix}-w{i}"
            process = stack.worker(name, list(spec.models), log_level="info",
                                   SHOAL_QUEUE_PREFIX=prefixes[i], SHOAL_PIN=",".join(spec.pin),
                                   SHOAL_DEVICE_MEMORY_BYTES=str(spec.budget_bytes),
                                   SHOAL_PLACEMENT=spec.placement,
                                   SHOAL_HOST_MEMORY_BYTES=str(spec.host_bytes),
                                   SHOAL_WORKER_METRICS_PORT=str(port))
            names.append(name)
            urls.append(f"http://127.0.0.1:{port}/metrics")
            pids.append(process.pid)
        for p in dict.fromkeys(prefixes):
            settings = Settings(queue_prefix=p)
            mine = [w for w, wp in zip(deployment.workers, prefixes, strict=True) if wp == p]
            for model in models:
                want = sum(model in w.models for w in mine)
                if not want:
                    continue
                queue = queue_for(model, settings).name
                wait_for(lambda q=queue, n=want: queue_counts(q, broker_url)[1] >= n, 120,
                         f"{want} consumer(s) of {queue}", interval=0.2, give_up=stack.exited)
        for url in urls:
            wait_for(lambda u=url: _get(u), 30, f"the worker metrics at {url}", interval=0.2)
        yield Fleet(list(dict.fromkeys(prefixes)), names, urls, pids, log_dir, stack)
    finally:
        stack.stop_all(timeout=30)
        for p in dict.fromkeys(prefixes):
            delete_queues(prefix_queues(p, models), broker_url)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


async def scrape(urls: Sequence[str]) -> list[dict[tuple[str, tuple], float]]:
    texts = await asyncio.gather(*(asyncio.to_thread(_get, u) for u in urls))
    return [parse_counters(t, COUNTERS) for t in texts]


def cpu_sample(pids: Sequence[int]) -> dict[str, Any]:
    """CPU seconds so far: the machine's busy and total (all cores), this process's, and
    each worker process's (with its children)."""
    import psutil

    times = psutil.cpu_times()
    total = sum(times)
    idle = times.idle + getattr(times, "iowait", 0.0)

    def used(pid: int) -> float | None:
        """The process's and its live descendants' CPU seconds (a worker's Celery may run
        in a child of the command started)."""
        try:
            process = psutil.Process(pid)
            family = [process, *process.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0.0
        for member in family:
            with contextlib.suppress(psutil.Error):
                t = member.cpu_times()
                total += t.user + t.system
        return total

    return {"machine_busy": total - idle, "machine_total": total,
            "client": used(os.getpid()), "workers": [used(p) for p in pids],
            "wall": time.perf_counter()}


# --- the load -------------------------------------------------------------------------------


@dataclass
class Outcome:
    rank: int  # 1-based popularity rank (at the time it was sent)
    sent: float  # scheduled send, perf_counter seconds
    done: float
    ok: bool
    error: str | None = None
    worker: str | None = None
    queue_ms: float | None = None
    busy_ms: float = 0.0  # its share of its batch's simulated device time
    message: str | None = None  # an error's text
    wall: float = 0.0  # time.time() of the reply, to find it in the workers' logs
    model: int = -1  # 0-based index into the first ranking
    burst: bool = False  # one of a burst's extra requests
    started: float = 0.0  # when the client got to send it, perf_counter seconds


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
                   timeout_s: float, model_index: int | None = None) -> Outcome:
        index = rank - 1 if model_index is None else model_index
        model = self.models[index]
        started = time.perf_counter()
        kwargs = {"model": model, "items": [{"text": t} for t in texts]}
        part = task_part(self.entries[model], kwargs, int(timeout_s * 1000))
        try:
            reply = await self.broker.submit(model, part, timeout_s)
        except Exception as exc:
            code = getattr(exc, "code", None)
            return Outcome(rank, scheduled, time.perf_counter(), False,
                           str(code) if code else type(exc).__name__, message=str(exc),
                           model=index, started=started)
        done = time.perf_counter()
        result = reply.get("result")
        if reply.get("status") != "SUCCESS":
            error = ShoalError.from_celery_failure(result)
            return Outcome(rank, scheduled, done, False, str(error.code),
                           message=error.message, wall=time.time(), model=index,
                           started=started)
        served = read_served(result if isinstance(result, dict) else {})
        batch = served.batch or {}
        queue_ms = (served.timing or {}).get("queue_ms")
        busy = float(batch.get("inference_ms", 0.0)) / max(1, int(batch.get("requests", 1)))
        return Outcome(rank, scheduled, done, True, None, served.worker,
                       None if queue_ms is None else float(queue_ms), busy, model=index,
                       started=started)


class MuxClient:
    """One Client per mux replica (its own queue prefix) behind a MuxRouter."""

    def __init__(self, prefixes: Sequence[str], models: Sequence[str], catalog_dir: Path,
                 slots: int) -> None:
        self.clients = [Client(p, models, catalog_dir) for p in prefixes]
        self.router = MuxRouter(len(self.clients), slots)
        self.routed = [0] * len(self.clients)

    async def start(self) -> None:
        await asyncio.gather(*(c.start() for c in self.clients))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def call(self, rank: int, texts: list[str], scheduled: float,
                   timeout_s: float, model_index: int | None = None) -> Outcome:
        index = rank - 1 if model_index is None else model_index
        replica = self.router.choose(index)
        self.routed[replica] += 1
        try:
            return await self.clients[replica].call(rank, texts, scheduled, timeout_s, index)
        finally:
            self.router.done(replica)


@dataclass
class Window:
    outcomes: list[Outcome] = field(default_factory=list)  # scheduled inside the window
    outside: list[Outcome] = field(default_factory=list)  # scheduled before it
    before: list[dict] = field(default_factory=list)
    after: list[dict] = field(default_factory=list)
    cpu: list[dict] = field(default_factory=list)  # cpu_sample at the start and the end
    seconds: float = 0.0
    start: float = 0.0  # perf_counter seconds
    end: float = 0.0
    run_start: float = 0.0  # perf_counter seconds of the plan's offset 0


async def drive(client: Client | MuxClient, plan: Plan, warmup: float, duration: float,
                urls: Sequence[str], timeout_s: float, pids: Sequence[int] = ()) -> Window:
    """Send the plan (its offsets from now); outcomes of requests scheduled after `warmup`,
    and the worker counters (and CPU times) at the window's start and end."""
    start = time.perf_counter()
    window = Window(seconds=duration, start=start + warmup, end=start + warmup + duration,
                    run_start=start)
    tasks: set[asyncio.Task] = set()

    async def one(i: int, scheduled: float) -> None:
        outcome = await client.call(plan.ranks[i], plan.texts[i], scheduled, timeout_s,
                                    plan.model(i))
        outcome.burst = plan.is_burst(i)
        inside = window.start <= scheduled < window.end
        (window.outcomes if inside else window.outside).append(outcome)

    async def edge(at: float, into: list) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        window.cpu.append(cpu_sample(pids))
        into.extend(await scrape(urls))

    meters = [asyncio.create_task(edge(window.start, window.before)),
              asyncio.create_task(edge(window.end, window.after))]
    for i, offset in enumerate(plan.offsets):
        at = start + offset
        if at >= window.end:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        task = asyncio.create_task(one(i, at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*meters)
    if tasks:
        await asyncio.gather(*tasks)
    return window
