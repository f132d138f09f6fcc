"""Prefetch follows the traffic: after large requests make workers return work and
shrink their prefetch, small requests grow it back (it used to stay at 1).

Two simulated workers (SHOAL_RUNTIME=sim, MiniLM's cpu profile) and a gateway run
under a private queue prefix; each worker's prefetch is read from its metrics.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.conftest import MINILM
from tests.stack import (
    free_port,
    http_status,
    private_stack,
    queue_counts,
    wait_for,
)

pytestmark = pytest.mark.e2e
TEXT = "the quick brown fox jumps over the lazy dog"


def _gauge(port: int, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise LookupError(f"{name} not exported on port {port}")


async def _post_all(url: str, bodies: list[dict], concurrency: int) -> list[int]:
    limit = asyncio.Semaphore(concurrency)

    async def post(client: httpx.AsyncClient, body: dict) -> int:
        async with limit:
            r = await client.post(url, json=body, headers={"x-timeout-ms": "60000"})
            return r.status_code

    async with httpx.AsyncClient(timeout=90) as client:
        return list(await asyncio.gather(*(post(client, b) for b in bodies)))


def test_prefetch_grows_back_after_returns_stop(tmp_path):
    with private_stack(tmp_path, "prefetch", MINILM) as private:
        prefix, queue, stack, port = private.prefix, private.queue, private.stack, private.port
        url = f"{private.url}/v1/encode/{MINILM}"
        metrics = [free_port(), free_port()]
        for i, metrics_port in enumerate(metrics):
            stack.worker(f"prefetch-{i}-{prefix}", [MINILM], SHOAL_QUEUE_PREFIX=prefix,
                         SHOAL_RUNTIME="sim", SHOAL_DEVICE="cpu", SHOAL_PREFETCH="64",
                         SHOAL_WORKER_METRICS_PORT=str(metrics_port))
        stack.gateway("prefetch-gateway", port, [MINILM], SHOAL_QUEUE_PREFIX=prefix)
        wait_for(lambda: http_status(f"http://127.0.0.1:{port}/readyz") == 200, 20,
                 "the gateway to be ready")
        wait_for(lambda: queue_counts(queue)[1] >= 2, 30, "both workers to consume")

        # Large requests, all at once: each fills a batch, so workers hold more than
        # their horizon and give work back.
        large = [{"items": [{"text": f"{i} {TEXT}"}] * 64} for i in range(48)]
        assert asyncio.run(_post_all(url, large, concurrency=48)) == [200] * 48
        returned = sum(_gauge(p, "shoal_returned_total") for p in metrics)
        assert returned > 0, "no worker returned work: the scenario did not happen"
        low = [_gauge(p, "shoal_prefetch") for p in metrics]
        assert max(low) <= 4, f"large requests should leave a small prefetch, got {low}"

        # Then only 1-item requests: each batch can hold 64 of them.
        stop = threading.Event()
        statuses: list[int] = []

        def small_traffic() -> None:
            n = 0
            while not stop.is_set() and n < 20_000:
                bodies = [{"items": [{"text": f"{n + k} {TEXT}"}]} for k in range(64)]
                statuses.extend(asyncio.run(_post_all(url, bodies, concurrency=16)))
                n += len(bodies)

        sender = threading.Thread(target=small_traffic, daemon=True)
        sender.start()
        try:
            wait_for(lambda: min(_gauge(p, "shoal_prefetch") for p in metrics) >= 32, 60,
                     "both workers' prefetch to grow back for 1-item requests")
        finally:
            stop.set()
            sender.join(timeout=60)
        assert statuses and set(statuses) == {200}
