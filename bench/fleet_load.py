"""bench.fleet's load: the simulated model and its env, one request's outcome and a
run's summary, the publisher that sends straight to the queues, and the closed and open
loops."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.broker.link import Broker
from tasks.catalog import load_catalog
from tasks.envelope import task_part
from tasks.served import read_served
from tasks.settings import Settings

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
