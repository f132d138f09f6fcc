"""Scale from zero: requests queued for a pool with no worker, then a worker started.

    .venv/bin/python -m bench.scale_from_zero [--runs 3] [--requests 8] [--json out.json]

What a KEDA-scaled pool at zero goes through, minus Kubernetes' own part (scheduling,
pulling the image, starting the container): a private gateway with
SHOAL_GATEWAY_UNSERVED=wait (as infra/k8s runs it) and no worker; `--requests` requests for
MiniLM are sent and wait in its queue (the message KEDA would see). Then one worker starts,
as the pod KEDA adds would, and the clock runs from its start until:
- ready: its /readyz answers 200 (what a readiness probe waits for);
- first / last: the first and the last queued request answered.
Two pools: `pinned` (SHOAL_PIN = the model: loaded before the worker is ready) and `lazy`
(SHOAL_PIN empty: ready at once, the first request loads the model). Each run starts a
fresh worker and drains it with SIGTERM after; every request must be answered 200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from app.tuning.stack import (
    Stack,
    delete_queues,
    free_port,
    http_status,
    prefix_queues,
    queue_counts,
    wait_for,
)
from tasks.settings import DEFAULT_MODEL, Settings
from tasks.topology import queue_for

POOLS = {"pinned": DEFAULT_MODEL, "lazy": ""}  # SHOAL_PIN of each


def _send(url: str, n: int, results: list[tuple[int, float]]) -> list[threading.Thread]:
    def one() -> None:
        r = httpx.post(f"{url}/v1/encode/{DEFAULT_MODEL}", timeout=300,
                       json={"items": [{"text": "a request sent while no worker runs"}]},
                       headers={"x-timeout-ms": "240000"})
        results.append((r.status_code, time.monotonic()))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads


def one_run(stack: Stack, url: str, queue: str, broker_url: str, pool: str, run: int,
            requests: int) -> dict[str, Any]:
    results: list[tuple[int, float]] = []
    threads = _send(url, requests, results)
    # Coalescing may publish several requests as one message: wait for all to be queued.
    wait_for(lambda: queue_counts(queue, broker_url)[0] >= 1, 30, "the queued requests")
    time.sleep(0.5)  # the rest of the burst joins; the clock starts with the worker
    queued = queue_counts(queue, broker_url)[0]
    metrics_port = free_port()
    started = time.monotonic()
    worker = stack.worker(f"{pool}-{run}-{os.getpid()}", [DEFAULT_MODEL], log_level="warning",
                          SHOAL_PIN=POOLS[pool], SHOAL_WORKER_METRICS_PORT=str(metrics_port))
    ready_url = f"http://127.0.0.1:{metrics_port}/readyz"
    wait_for(lambda: http_status(ready_url, timeout=1) == 200, 300, "the worker ready",
             interval=0.02, give_up=lambda: None if worker.alive() else "the worker exited")
    ready = time.monotonic() - started
    for thread in threads:
        thread.join(300)
    statuses = [status for status, _ in results]
    assert statuses == [200] * requests, f"{pool} run {run}: {statuses}"
    answered = sorted(at - started for _, at in results)
    worker.stop(timeout=40)
    return {"pool": pool, "run": run, "requests": requests, "messages_queued": queued,
            "ready_s": round(ready, 3), "first_answer_s": round(answered[0], 3),
            "last_answer_s": round(answered[-1], 3), "exit_code": worker.proc.returncode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--pools", default="pinned,lazy")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    pools = [p for p in args.pools.split(",") if p]

    prefix = f"shoal-bench-zero-{os.getpid()}"
    settings = Settings(queue_prefix=prefix)
    queue = queue_for(DEFAULT_MODEL, settings).name
    env = {**os.environ, "SHOAL_QUEUE_PREFIX": prefix, "SHOAL_GATEWAY_UNSERVED": "wait"}
    stack = Stack(env, Path(tempfile.mkdtemp(prefix="shoal-bench-zero-")))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    samples: list[dict[str, Any]] = []
    try:
        stack.gateway("gateway", port, [DEFAULT_MODEL])
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 120, "the gateway",
                 give_up=stack.exited)
        with tqdm(total=args.runs * len(pools), desc="scale from zero", unit="run") as bar:
            for run in range(args.runs):
                for pool in pools:
                    samples.append(one_run(stack, url, queue, settings.broker_url, pool, run,
                                           args.requests))
                    bar.update()
    finally:
        stack.stop_all(timeout=40)
        delete_queues(prefix_queues(prefix, [DEFAULT_MODEL]), settings.broker_url)

    print(f"\n{args.requests} requests queued with no worker, then one worker started "
          f"(medians of {args.runs} runs; seconds from the worker's start):")
    print(f"{'pool':8} {'ready':>7} {'first answer':>13} {'last answer':>12}")
    summary = {}
    for pool in pools:
        rows = [s for s in samples if s["pool"] == pool]
        med = {k: statistics.median(s[k] for s in rows)
               for k in ("ready_s", "first_answer_s", "last_answer_s")}
        summary[pool] = med
        print(f"{pool:8} {med['ready_s']:7.2f} {med['first_answer_s']:13.2f} "
              f"{med['last_answer_s']:12.2f}")
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
