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
from tests.conftest import HEARTBEAT_S, MINILM, RESTART, queue_name
from tests.stack import queue_counts, wait_for
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

    async def main() -> list[np.ndarray]:
        async with httpx.AsyncClient(timeout=200) as client:
            calls = [asyncio.create_task(request(client, i)) for i in range(len(texts))]
            # No worker serves this model yet: everything queues in RabbitMQ.
            await asyncio.to_thread(wait_for, lambda: queue_counts(queue_name(RESTART))[0]
                                    == len(texts), 30, "all requests to be queued")
            first = stack.stack.worker(f"restart-a-{how.name}", [RESTART])
            await asyncio.to_thread(wait_for, lambda: done, 120, "a first result")
            first.kill(how)
            await asyncio.to_thread(wait_for, lambda: not first.alive(), 60,
                                    "the first worker to exit")
            state["done_at_kill"] = len(done)
            second = stack.stack.worker(f"restart-b-{how.name}", [RESTART])
            try:
                return await asyncio.gather(*calls)
            finally:
                second.stop()

    results = asyncio.run(main())
    assert state["done_at_kill"] < len(texts), "the worker finished before it was stopped"
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
