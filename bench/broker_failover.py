"""A broker node stopped under load: the leader of the model's queue on a 3-node cluster.

    .venv/bin/python -m bench.broker_failover [--runs 3] [--model MODEL] [--json out.json]

Starts a 3-node RabbitMQ cluster of its own (infra/rabbitmq-cluster.sh, a private
folder, node names and ports), and a private stack on it (one gateway, one worker,
SHOAL_BROKER_URL listing the three nodes). Each run: `--clients` concurrent clients send
a steady stream of requests (one text each, from `--texts` distinct texts whose vectors
were taken first); after `--before` seconds the node that leads the model's queue (the
management API's `leader`) is stopped (`stop-node`, a clean shutdown: its connections
are closed at once); the load goes on `--after` seconds; the node is started again
before the next run (and leads nothing then: the queue's leader moved).

A client sends a request again when the gateway answers 503 (BROKER_UNAVAILABLE,
retryable) or the connection fails, as a client should; a request is *answered* when
it gets a 200 whose vector is its text's, *lost* when it never does (another status, a
wrong vector, or its deadline passed), *answered twice* if two of its sends got a 200.

Reported per run, and the median of the runs: requests sent, answered, lost (must be 0),
answered twice (must be 0), sends refused with a retryable 503, the p50/p99 latency of
the requests sent in the `--fault-window` seconds after the stop (retries included),
seconds to recover (from the stop until a request sent after it is answered), the
longest gap between two answers, and the gateway's duplicate replies dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.tuning.stats import percentile
from bench.broker_failover_cluster import REPO, Cluster, running_cluster
from bench.lib.minilm import MINILM

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
RETRYABLE = {503}


# --------------------------------------------------------------------------- the load


@dataclass
class Request:
    index: int
    text: int  # which of the distinct texts
    sent: float = 0.0  # monotonic, first send
    done: float | None = None  # monotonic, when it was answered (or given up)
    sends: int = 0
    refused: int = 0  # retryable 503s and connection errors it met
    answers: int = 0  # 200s with its own vector
    wrong: int = 0  # 200s with another vector
    failure: str | None = None


@dataclass
class Load:
    """Clients that send one request after another until `stop` is set."""

    url: str
    model: str
    references: list[list[float]]
    clients: int = 8
    timeout_ms: int = 30_000
    requests: list[Request] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def text(self, i: int) -> str:
        return f"request text number {i}: the broker failover load"

    async def run(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout_ms / 1000 + 10) as client:
            await asyncio.gather(*(self._client(client) for _ in range(self.clients)))

    async def _client(self, client: Any) -> None:
        while not self.stopping.is_set():
            request = Request(len(self.requests), len(self.requests) % len(self.references))
            self.requests.append(request)
            await self._send(client, request)

    async def _send(self, client: Any, request: Request) -> None:
        import httpx

        loop = asyncio.get_running_loop()
        request.sent = loop.time()
        deadline = request.sent + self.timeout_ms / 1000
        while loop.time() < deadline:
            request.sends += 1
            try:
                r = await client.post(f"{self.url}/v1/encode/{self.model}",
                                      json={"items": [{"text": self.text(request.text)}]},
                                      headers={"x-timeout-ms": str(self.timeout_ms)})
            except httpx.HTTPError as exc:
                request.refused += 1
                request.failure = repr(exc)
                await asyncio.sleep(0.1)
                continue
            if r.status_code in RETRYABLE:
                request.refused += 1
                request.failure = r.text[:200]
                await asyncio.sleep(0.1)
                continue
            request.done = loop.time()
            if r.status_code != 200:
                request.failure = f"{r.status_code}: {r.text[:200]}"
                return
            if _same(r.json()["embeddings"][0], self.references[request.text]):
                request.answers += 1
                request.failure = None
            else:
                request.wrong += 1
                request.failure = "a vector of another text"
            return
        request.done = loop.time()
        request.failure = f"no answer within {self.timeout_ms} ms: {request.failure}"


def _same(a: list[float], b: list[float]) -> bool:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return norm > 0 and dot / norm >= 0.9999


async def references(url: str, model: str, n: int, load: Load | None = None) -> list[list[float]]:
    """The vector of each distinct text, asked of the stack before any fault."""
    import httpx

    texts = [(load or Load(url, model, [[]])).text(i) for i in range(n)]
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{url}/v1/encode/{model}",
                              json={"items": [{"text": t} for t in texts]})
        r.raise_for_status()
        return r.json()["embeddings"]


def summarize(requests: list[Request], fault_at: float, window_s: float) -> dict[str, Any]:
    """The figures of one run (times in the load's monotonic clock; `fault_at`: the stop)."""
    answered = [r for r in requests if r.answers >= 1]
    lost = [r for r in requests if r.answers == 0]
    during = sorted((r.done - r.sent) * 1000 for r in answered
                    if fault_at <= r.sent < fault_at + window_s and r.done is not None)
    after = [r.done for r in answered if r.sent >= fault_at and r.done is not None]
    ends = sorted(r.done for r in answered if r.done is not None)
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "sent": len(requests),
        "answered": len(answered),
        "lost": len(lost),
        "answered_twice": sum(1 for r in requests if r.answers > 1),
        "wrong_vectors": sum(r.wrong for r in requests),
        "retryable_refusals": sum(r.refused for r in requests),
        "p50_fault_ms": _percentile(during, 50),
        "p99_fault_ms": _percentile(during, 99),
        "recover_s": (min(after) - fault_at) if after else None,
        "longest_gap_s": max(gaps, default=None),
        "lost_examples": [r.failure for r in lost[:5]],
    }


def _percentile(values: list[float], q: float) -> float | None:
    # Nearest rank: the smallest value with at least q% of the values at or below it.
    return percentile(values, q, method="inverted_cdf")


async def stop_leader_under_load(cluster: Cluster, url: str, model: str, queue: str,
                                 refs: list[list[float]], before_s: float, after_s: float,
                                 clients: int) -> tuple[dict[str, Any], int]:
    """One run: load, stop the queue's leader, load on; (its summary, the node stopped)."""
    load = Load(url, model, refs, clients=clients)
    loop = asyncio.get_running_loop()
    runner = loop.create_task(load.run())
    await asyncio.sleep(before_s)
    node = cluster.leader(queue)
    fault_at = loop.time()
    await asyncio.to_thread(cluster.stop_node, node)
    await asyncio.sleep(after_s)
    load.stopping.set()
    await runner
    return summarize(load.requests, fault_at, after_s), node


# --------------------------------------------------------------------------- the stack


def stack_env(cluster: Cluster, prefix: str, **extra: str) -> dict[str, str]:
    return {**os.environ, **OFFLINE_ENV, "SHOAL_BROKER_URL": cluster.broker_url,
            "SHOAL_MANAGEMENT_URL": cluster.management_url, "SHOAL_QUEUE_PREFIX": prefix,
            "SHOAL_BROKER_HEARTBEAT": "2", **extra}


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples at a /metrics URL."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.broker_failover", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=MINILM)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--texts", type=int, default=16, help="distinct texts")
    parser.add_argument("--before", type=float, default=3.0, help="seconds of load before")
    parser.add_argument("--after", type=float, default=12.0, help="seconds of load after")
    parser.add_argument("--fault-window", type=float, default=None,
                        help="p99 over requests sent this long after the stop (default: --after)")
    parser.add_argument("--json", type=Path, help="write every run and the medians here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from app.tuning.stack import Stack, free_port, http_status, wait_for
    from tasks.settings import Settings
    from tasks.topology import queue_for

    args = parse_args(argv)
    if (why := Cluster.available()) is not None:
        print(why, file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-failover-"))
    prefix = f"shoal-bench-failover-{uuid.uuid4().hex[:6]}"
    queue = queue_for(args.model, Settings(queue_prefix=prefix)).name
    runs: list[dict[str, Any]] = []
    with running_cluster(work / "cluster") as cluster:
        stack = Stack(stack_env(cluster, prefix), work, cwd=REPO)
        port, metrics_port = free_port(), free_port()
        stack.worker(f"failover-{uuid.uuid4().hex[:6]}", [args.model],
                     SHOAL_WORKER_METRICS_PORT=str(metrics_port))
        stack.gateway("gateway", port, [args.model])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: http_status(f"{url}/readyz") == 200, 120, "the gateway",
                     give_up=stack.exited)
            wait_for(lambda: cluster.queue_consumers(queue) >= 1, 300, "the worker",
                     give_up=stack.exited)
            refs = asyncio.run(references(url, args.model, args.texts))
            for _ in tqdm(range(args.runs), unit="run", file=sys.stderr):
                duplicates = metric(f"{url}/metrics", "shoal_gateway_duplicate_replies_total")
                summary, node = asyncio.run(stop_leader_under_load(
                    cluster, url, args.model, queue, refs, args.before,
                    args.fault_window or args.after, args.clients))
                summary["node_stopped"] = node
                summary["duplicate_replies_dropped"] = metric(
                    f"{url}/metrics", "shoal_gateway_duplicate_replies_total") - duplicates
                runs.append(summary)
                print(json.dumps(summary), file=sys.stderr)
                cluster.start_node(node)
        except BaseException:
            stack.print_logs()
            raise
        finally:
            stack.stop_all()
    keys = ["sent", "answered", "lost", "answered_twice", "retryable_refusals",
            "p50_fault_ms", "p99_fault_ms", "recover_s", "longest_gap_s",
            "duplicate_replies_dropped"]
    medians = {k: statistics.median(v) if (v := [r[k] for r in runs if r[k] is not None])
               else None for k in keys}
    print(f"{'':>26} " + " ".join(f"run {i + 1:>2}" for i in range(len(runs))) + "   median")
    for k in keys:
        cells = " ".join(f"{_fmt(r[k]):>6}" for r in runs)
        print(f"{k:>26} {cells}   {_fmt(medians[k]):>6}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "median": medians, "model": args.model,
                                         "clients": args.clients}, indent=2))
    return 0 if all(r["lost"] == 0 and r["answered_twice"] == 0 for r in runs) else 1


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
