"""Workers come and go; heartbeats flow during long batches; no request is lost."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import signal
import urllib.request

import httpx
import numpy as np
import pytest

from runtimes.pytorch.dense import DenseEncoder
from tests.conftest import FAULTY, HEARTBEAT_S, MINILM, RESTART, queue_name
from tests.slow_batches import SlowBatches
from tests.stack import free_port, metric_sum, queue_counts, wait_for
from tests.tiny_models import MINILM_DIR

pytestmark = pytest.mark.e2e
MANAGEMENT = "http://127.0.0.1:15672/api"


def _management(path: str) -> list[dict]:
    request = urllib.request.Request(f"{MANAGEMENT}{path}")
    token = base64.b64encode(b"guest:guest").decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_worker_restart_while_requests_are_queued_loses_nothing(stack, how):
    texts = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 20
             for i in range(24)]
    expected = DenseEncoder(str(MINILM_DIR)).encode(texts)
    done: list[int] = []
    state: dict[str, int] = {}

    async def request(client: httpx.AsyncClient, i: int) -> np.ndarray:
        r = await client.post(f"{stack.url}/v1/encode/{RESTART}",
                              json={"items": [{"text": texts[i]}] * 3},
                              headers={"x-timeout-ms": "180000"})
        assert r.status_code == 200, r.text
        done.append(i)
        return np.array(r.json()["embeddings"], dtype=np.float32)

    metrics = f"{stack.url}/metrics"
    published = "shoal_gateway_requests_per_message_sum"
    before = metric_sum(metrics, published)

    async def main() -> list[np.ndarray]:
        async with httpx.AsyncClient(timeout=200) as client:
            calls = [asyncio.create_task(request(client, i)) for i in range(len(texts))]
            # No worker serves this model yet: everything queues in RabbitMQ (in fewer
            # messages than requests where the gateway coalesced them).
            await asyncio.to_thread(wait_for, lambda: metric_sum(metrics, published) - before
                                    == len(texts), 30, "all requests to be published")
            first = stack.stack.worker(f"restart-a-{how.name}", [RESTART])
            await asyncio.to_thread(wait_for, lambda: done, 120, "a first result")
            first.kill(how)
            await asyncio.to_thread(wait_for, lambda: not first.alive(), 60,
                                    "the first worker to exit")
            state["done_at_kill"] = len(done)
            state["exit_code"] = first.proc.returncode
            second = stack.stack.worker(f"restart-b-{how.name}", [RESTART])
            try:
                return await asyncio.gather(*calls)
            finally:
                second.stop()

    results = asyncio.run(main())
    if how == signal.SIGKILL:
        assert state["done_at_kill"] < len(texts), "the worker finished before it was killed"
    else:
        # SIGTERM drains (app.worker.shutdown): the first worker finishes what runs, which may be
        # everything it had started, hands the rest back, and exits 0, not forced.
        assert state["exit_code"] == 0, state
    assert sorted(done) == list(range(len(texts)))  # each answered exactly once
    for i, vectors in enumerate(results):
        assert vectors.shape == (3, 384)
        assert (vectors @ expected[i]).min() >= 0.9999  # each got its own answer


def test_heartbeats_flow_while_a_batch_runs_longer_than_two_intervals(stack):
    """The model runs off the event loop, so the worker's AMQP connections survive."""
    text = "the quick brown fox jumps over the lazy dog " * 40  # past 256 tokens
    url = f"{stack.url}/v1/encode/{MINILM}"
    probe = httpx.post(url, json={"items": [{"text": text}] * 32}, timeout=120)
    per_item_ms = float(probe.headers["x-inference-time-ms"]) / 32
    items = min(2048, math.ceil(3 * HEARTBEAT_S * 1000 / per_item_ms))
    # The management API lists a connection a few seconds after it opens.
    wait_for(lambda: any(c.get("timeout") == HEARTBEAT_S for c in _management("/connections")),
             30, f"a connection with a {HEARTBEAT_S}s heartbeat")
    before = {c["name"] for c in _management("/connections")
              if c.get("timeout") == HEARTBEAT_S}

    r = httpx.post(url, json={"items": [{"text": text}] * items}, timeout=300)
    assert r.status_code == 200, r.text
    inference_s = float(r.headers["x-inference-time-ms"]) / 1000
    assert inference_s > 2 * HEARTBEAT_S, f"the batch took only {inference_s:.1f}s"

    after = {c["name"] for c in _management("/connections")}
    assert before <= after, f"connections dropped during the batch: {before - after}"
    assert "Connection to broker lost" not in stack.worker.log()
    assert stack.worker.alive()


def test_a_busy_worker_leaves_queued_work_to_an_idle_one(stack, tmp_path):
    """One worker stalls on a slow batch; the quick requests dealt out meanwhile are run
    by the idle one, whichever way the busy one leaves them: it returns what it was dealt,
    or takes nothing in while its batch runs past its hold horizon. That returns happen is
    test_prefetch's to prove (it asserts them); here, where the work ends up."""
    ports = {name: free_port() for name in ("busy-or-idle-1", "busy-or-idle-2")}
    slow_batches = SlowBatches(tmp_path / "slow", slow_s=6)
    workers = {
        name: stack.stack.worker(name, [FAULTY], SHOAL_WORKER_METRICS_PORT=str(port),
                                 **slow_batches.env)
        for name, port in ports.items()
    }
    try:
        wait_for(lambda: queue_counts(queue_name(FAULTY))[1] >= 2, 120, "both workers")

        async def main() -> tuple[httpx.Response, list[httpx.Response]]:
            async with httpx.AsyncClient(timeout=120) as client:
                url = f"{stack.url}/v1/encode/{FAULTY}"
                slow = asyncio.create_task(client.post(url, json={"items": [{"text": "@@slow@@"}]}))
                await asyncio.to_thread(slow_batches.wait_started, 1)
                # Both workers have credit, so the broker deals these out to both.
                rest = await asyncio.gather(*(
                    client.post(url, json={"items": [{"text": f"quick {i}"}]})
                    for i in range(30)))
                return await slow, rest

        slow, rest = asyncio.run(main())
        assert slow.status_code == 200 and all(r.status_code == 200 for r in rest)
        busy = slow.headers["x-worker"].split("@")[0]
        idle = next(name for name in workers if name != busy)
        idle_share = sum(r.headers["x-worker"].startswith(idle + "@") for r in rest) / len(rest)
        returned = metric_sum(f"http://127.0.0.1:{ports[busy]}/metrics",
                              "shoal_returned_total")
        print(f"idle worker's share {idle_share:.0%}, returns by the busy one: {returned:.0f}")
        # The busy worker either returns what it was dealt or, its running batch ending
        # beyond its hold horizon, takes nothing in (batching.hold.may_hold): both leave
        # the quick requests to the idle one.
        assert idle_share >= 0.8, (f"the idle worker ran only {idle_share:.0%} of the "
                                   f"requests (the busy one returned {returned:.0f})")
    finally:
        for worker in workers.values():
            worker.stop()


def test_kill_9_of_a_worker_under_load_every_request_completes_once(stack):
    texts = [f"load test sentence number {i} about rivers and mountains" for i in range(64)]
    expected = DenseEncoder(str(MINILM_DIR)).encode(texts)
    second = stack.stack.worker("second", [RESTART])
    victim = stack.stack.worker("victim", [RESTART])
    wait_for(lambda: queue_counts(queue_name(RESTART))[1] >= 2, 120, "both workers")
    answered: list[int] = []

    async def client(http: httpx.AsyncClient, i: int) -> None:
        for round_ in range(6):
            k = (i * 6 + round_) % len(texts)
            r = await http.post(f"{stack.url}/v1/encode/{RESTART}",
                                json={"items": [{"text": texts[k]}]},
                                headers={"x-timeout-ms": "120000"})
            assert r.status_code == 200, r.text
            vector = np.array(r.json()["embeddings"][0], dtype=np.float32)
            assert vector @ expected[k] >= 0.9999
            answered.append(k)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=150) as http:
            clients = asyncio.gather(*(client(http, i) for i in range(16)))
            await asyncio.to_thread(wait_for, lambda: len(answered) >= 20, 120,
                                    "the load to be running")
            victim.kill(signal.SIGKILL)
            await clients

    try:
        asyncio.run(main())
        assert len(answered) == 16 * 6
        assert not victim.alive()
    finally:
        second.stop()
