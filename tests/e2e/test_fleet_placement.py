"""The fleet's placement (SHOAL_PLACEMENT=fleet, the default) with real workers.

Simulated workers (SHOAL_RUNTIME=sim: real Celery workers and RabbitMQ; batches and loads
sleep as the profile says) under a private queue prefix, each with its own /metrics.
Which worker answered is read from X-Worker; what each loaded from its
shoal_model_loads_total.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.conftest import MINILM
from tests.stack import (
    delete_queues,
    free_port,
    http_status,
    metric_sum,
    model_loads,
    private_stack,
    queue_counts,
    wait_for,
)

pytestmark = pytest.mark.e2e
E5, GTE = "intfloat/e5-small-v2", "thenlper/gte-small"
MB = 2**20
FAST = {"SHOAL_RUNTIME": "sim", "SHOAL_DEVICE": "cpu", "SHOAL_POOL_STATE_INTERVAL_S": "0.5"}


async def post_paced(url: str, model: str, n: int, every_s: float,
                     timeout_ms: int = 60_000) -> list[httpx.Response]:
    """`n` one-text requests, one every `every_s` (open loop: a light, steady load)."""
    async with httpx.AsyncClient(timeout=90) as client:
        async def one(i: int) -> httpx.Response:
            await asyncio.sleep(i * every_s)
            return await client.post(f"{url}/v1/encode/{model}",
                                     json={"items": [{"text": f"text {i}"}]},
                                     headers={"x-timeout-ms": str(timeout_ms)})

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def start_workers(private, names: list[str], models: list[str], **env: str) -> list[int]:
    ports = []
    for name in names:
        port = free_port()
        private.stack.worker(name, models, SHOAL_PIN="", SHOAL_QUEUE_PREFIX=private.prefix,
                             SHOAL_WORKER_METRICS_PORT=str(port), **{**FAST, **env})
        ports.append(port)
    private.stack.gateway(f"gw-{private.prefix}", private.port, None,
                          SHOAL_QUEUE_PREFIX=private.prefix)
    wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 30, "the gateway")
    for port in ports:
        wait_for(lambda p=port: httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=2),
                 30, "the worker's metrics")
    return ports


def test_one_worker_holds_a_model_until_its_demand_calls_for_a_second_copy(tmp_path):
    with private_stack(tmp_path, "fleet-copies", MINILM) as private:
        names = [f"a-{private.prefix}", f"b-{private.prefix}"]
        # 20 ms a batch: 10 requests a second keep a device a fifth busy
        ports = start_workers(private, names, [MINILM], SHOAL_SIM_COST_A_MS="20",
                              SHOAL_SIM_COST_B_US="0", SHOAL_SIM_COST_C_NS="0")
        wait_for(lambda: queue_counts(private.queue)[1] >= 2, 30, "both workers")
        light = asyncio.run(post_paced(private.url, MINILM, 60, 0.1))
        assert [r.status_code for r in light] == [200] * 60
        # One worker loaded it and served it all; the other stood by.
        assert sorted(model_loads(p, MINILM) for p in ports) == [0.0, 1.0]
        assert len({r.headers["x-worker"] for r in light[5:]}) == 1
        idle = ports[[model_loads(p, MINILM) for p in ports].index(0.0)]
        wait_for(lambda: metric_sum(f"http://127.0.0.1:{idle}/metrics",
                                    "shoal_model_standby") == 1, 10, "the other to stand by")

        # Heavy: 8 clients back to back keep one device busy: a second copy loads.
        stop = threading.Event()
        answered: list[int] = []

        def heavy() -> None:
            with httpx.Client(timeout=90) as client:
                while not stop.is_set():
                    answered.append(client.post(
                        f"{private.url}/v1/encode/{MINILM}",
                        json={"items": [{"text": "busy"}] * 4}).status_code)

        threads = [threading.Thread(target=heavy) for _ in range(8)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: model_loads(idle, MINILM) == 1, 60, "the second copy's load")
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
        assert set(answered) == {200}


def test_a_worker_killed_holding_the_only_copy_another_loads_it_and_nothing_is_lost(
        tmp_path):
    with private_stack(tmp_path, "fleet-kill", MINILM) as private:
        names = [f"a-{private.prefix}", f"b-{private.prefix}"]
        # 300 ms a batch: requests are held by the holder when it dies
        ports = start_workers(private, names, [MINILM], SHOAL_SIM_COST_A_MS="300",
                              SHOAL_SIM_COST_B_US="0", SHOAL_SIM_COST_C_NS="0")
        wait_for(lambda: queue_counts(private.queue)[1] >= 2, 30, "both workers")
        (first,) = asyncio.run(post_paced(private.url, MINILM, 1, 0))
        assert first.status_code == 200
        holder = next(i for i, p in enumerate(ports) if model_loads(p, MINILM) == 1)
        other = 1 - holder
        wait_for(lambda: metric_sum(f"http://127.0.0.1:{ports[other]}/metrics",
                                    "shoal_model_standby") == 1, 10, "the other to stand by")
        results: list[list[httpx.Response]] = []
        sender = threading.Thread(target=lambda: results.append(
            asyncio.run(post_paced(private.url, MINILM, 30, 0.05))))
        sender.start()
        wait_for(lambda: metric_sum(f"http://127.0.0.1:{ports[holder]}/metrics",
                                    "shoal_held_messages") >= 2, 20, "the holder to hold requests")
        process = next(p for p in private.stack.processes if p.name == names[holder])
        process.kill()
        sender.join(120)
        (responses,) = results
        assert [r.status_code for r in responses] == [200] * 30
        assert model_loads(ports[other], MINILM) == 1
        assert {r.headers["x-worker"].split("@")[0] for r in responses[-5:]} == {names[other]}


def test_a_pinned_model_stays_while_the_others_swap_through_the_rest(tmp_path):
    models = [MINILM, E5, GTE]
    with private_stack(tmp_path, "fleet-pin", MINILM) as private:
        port = free_port()
        try:
            private.stack.worker(f"w-{private.prefix}", models, SHOAL_PIN=MINILM,
                                 SHOAL_QUEUE_PREFIX=private.prefix,
                                 SHOAL_WORKER_METRICS_PORT=str(port),
                                 SHOAL_DEVICE_MEMORY_BYTES=str(250 * MB),  # room for 2
                                 **FAST)
            private.stack.gateway(f"gw-{private.prefix}", private.port, None,
                                  SHOAL_QUEUE_PREFIX=private.prefix)
            wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 30, "the gateway")
            wait_for(lambda: queue_counts(private.queue)[1] >= 1, 30, "the worker")
            for round_ in range(3):
                for model in (E5, GTE):
                    (r,) = asyncio.run(post_paced(private.url, model, 1, 0))
                    assert r.status_code == 200, (round_, model, r.text)
                    (r,) = asyncio.run(post_paced(private.url, MINILM, 1, 0))
                    assert r.status_code == 200
            url = f"http://127.0.0.1:{port}/metrics"
            assert model_loads(port, E5) >= 2 and model_loads(port, GTE) >= 2  # they swapped
            text = httpx.get(url, timeout=5).text
            assert f'shoal_model_evictions_total{{model="{MINILM}"' not in text
        finally:
            delete_queues([f"{private.prefix}.{m}" for m in models])


def test_a_budget_smaller_than_the_pinned_models_refuses_to_start(tmp_path):
    with private_stack(tmp_path, "fleet-nofit", MINILM) as private:
        worker = private.stack.worker(f"w-{private.prefix}", [MINILM], SHOAL_PIN=MINILM,
                                      SHOAL_QUEUE_PREFIX=private.prefix,
                                      SHOAL_DEVICE_MEMORY_BYTES=str(50 * MB), **FAST)
        started = time.monotonic()
        wait_for(lambda: not worker.alive(), 60, "the worker to refuse to start")
        assert worker.proc.returncode != 0
        log = worker.log()
        assert "SHOAL_PIN" in log and "SHOAL_DEVICE_MEMORY_BYTES" in log, log[-2000:]
        assert "100.0 MiB" in log and "50.0 MiB" in log, log[-2000:]
        assert time.monotonic() - started < 60
