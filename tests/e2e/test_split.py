"""A request too big for one batch runs as parts, and small requests are not stuck
behind it."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from tests.conftest import RESTART, queue_name
from tests.stack import free_port, metric_sum, queue_counts, wait_for

pytestmark = pytest.mark.e2e


def test_small_requests_go_between_the_parts_of_a_big_one(stack):
    metrics_port = free_port()
    # A simulated device taking 300 ms a batch of at most 8 items: 64 items are 8 parts.
    worker = stack.stack.worker(f"split-{uuid.uuid4().hex[:6]}", [RESTART],
                                SHOAL_RUNTIME="sim", SHOAL_SIM_COST_A_MS="300",
                                SHOAL_SIM_COST_B_US="0", SHOAL_SIM_COST_C_NS="0",
                                SHOAL_BATCH_MAX_ITEMS="8", SHOAL_PART_TARGET_MS="60000",
                                SHOAL_WORKER_METRICS_PORT=str(metrics_port))
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    url = f"{stack.url}/v1/encode/{RESTART}"
    texts = [f"big request item {i}" for i in range(64)]
    try:
        wait_for(lambda: queue_counts(queue_name(RESTART))[1] >= 1, 120, "the sim worker")

        async def main() -> tuple[httpx.Response, httpx.Response, list[str]]:
            finished: list[str] = []
            async with httpx.AsyncClient(timeout=60) as client:
                async def post(name: str, items: list[str]) -> httpx.Response:
                    response = await client.post(url, json={"items": [{"text": t}
                                                                      for t in items]})
                    finished.append(name)
                    return response

                big = asyncio.create_task(post("big", texts))
                # Once its first part runs, a small request arrives.
                await asyncio.to_thread(wait_for, lambda: metric_sum(
                    metrics, "shoal_batch_requests_count") >= 1, 30, "the first part")
                small = await post("small", ["a small request"])
                return await big, small, finished

        big, small, finished = asyncio.run(main())
        alone = httpx.post(url, json={"items": [{"text": texts[37]}]}, timeout=60)
        # Its 8 parts take 2.4 s: with a 1.5 s deadline it is refused before any part runs
        # (measured batches back the prediction by now), naming the deadline that would do.
        batches = metric_sum(metrics, "shoal_batch_requests_count")
        short = httpx.post(url, json={"items": [{"text": t} for t in texts]},
                           headers={"X-Timeout-Ms": "1500"}, timeout=60)
        batches_after = metric_sum(metrics, "shoal_batch_requests_count")
        split = metric_sum(metrics, "shoal_split_requests_total")
        # A Celery client skips the gateway's checks: a bad item fails the request, and
        # the error says which part and items it came from.
        from tasks.client import encode
        from tasks.errors import ShoalError

        bad = [{"text": t} for t in texts]
        bad[50] = {"text": 42}
        with pytest.raises(ShoalError) as error:
            encode.delay(model=RESTART, items=bad).get(timeout=60)
    finally:
        worker.stop()
    assert big.status_code == 200 and small.status_code == 200, (big.text, small.text)
    assert finished == ["small", "big"]
    assert big.headers["x-batch-parts"] == "8"
    body = big.json()
    assert len(body["embeddings"]) == 64 and body["usage"]["tokens"] > 0
    # The parts' results joined in order: item 37 is the vector of its own text.
    assert body["embeddings"][37] == alone.json()["embeddings"][0]
    assert short.status_code == 422, short.text
    assert short.json()["error"]["code"] == "DEADLINE_TOO_SHORT"
    assert "run as 8 parts" in short.text and "X-Timeout-Ms: " in short.text, short.text
    assert short.headers["x-should-retry"] == "false"
    assert batches_after == batches  # none of its parts ran
    assert split == 2
    assert error.value.code == "VALIDATION_ERROR"
    assert error.value.message.startswith("items 48-55 (part 7 of 8): "), error.value.message
