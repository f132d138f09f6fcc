"""A request that crashes or breaks the model fails alone; dead letters are answered."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import msgpack
import pytest
from kombu import Connection, Producer

from tasks.queues import kombu_queues
from tasks.settings import Settings
from tasks.topology import queue_for
from tests.conftest import DLQ, FAULTY, queue_name
from tests.slow_batches import SlowBatches
from tests.stack import BROKER_URL, free_port, metric_sum, queue_counts, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def slow_batches(tmp_path_factory: pytest.TempPathFactory) -> SlowBatches:
    return SlowBatches(tmp_path_factory.mktemp("isolation-slow"), slow_s=0.0)


@pytest.fixture(scope="module")
def faulty_worker(stack, slow_batches):
    port = free_port()
    worker = stack.stack.worker("faulty", [FAULTY], SHOAL_WORKER_METRICS_PORT=str(port),
                                **slow_batches.env)
    wait_for(lambda: queue_counts(queue_name(FAULTY))[1] >= 1, 120, "the faulty worker")
    yield worker, f"http://127.0.0.1:{port}/metrics"
    slow_batches.release()
    worker.stop()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}")


@pytest.mark.parametrize("marker", ["@@crash@@", "@@raise@@"])
def test_poison_request_fails_alone_among_a_batch(stack, faulty_worker, slow_batches, marker):
    worker, metrics_url = faulty_worker
    restarts_before = _metric(metrics_url, "shoal_runtime_restarts")

    texts = [f"good text {i}" for i in range(7)] + [f"bad {marker} text"]

    published = f"{stack.url}/metrics", "shoal_gateway_requests_per_message_sum"

    def all_published() -> bool:  # (coalesced or not) the stalled request and the rest
        return metric_sum(*published) >= before + 1 + len(texts)

    async def main() -> list[httpx.Response]:
        # Isolating a crash costs a few runtime restarts: allow for them.
        async with httpx.AsyncClient(timeout=180, headers={"x-timeout-ms": "170000"}) as client:
            # A stalled first batch makes the rest queue up and share one batch.
            stall = client.post(f"{stack.url}/v1/encode/{FAULTY}",
                                json={"items": [{"text": "@@slow@@"}]})
            first = asyncio.create_task(stall)
            await asyncio.to_thread(slow_batches.wait_started, started + 1)
            rest = [asyncio.create_task(
                client.post(f"{stack.url}/v1/encode/{FAULTY}", json={"items": [{"text": t}]}))
                for t in texts]
            await asyncio.to_thread(wait_for, all_published, 60,
                                    "every request to be published")
            slow_batches.release()
            return [await first, *await asyncio.gather(*rest)]

    before = metric_sum(*published)
    started = slow_batches.started()
    slow_batches.hold()
    try:
        responses = asyncio.run(main())
    finally:
        slow_batches.release()
    assert all(r.status_code == 200 for r in responses[:-1]), [r.text for r in responses]
    assert max(int(r.headers["x-batch-requests"]) for r in responses[1:-1]) > 1
    poisoned = responses[-1]
    assert poisoned.status_code == 422, poisoned.text
    assert poisoned.json()["error"]["code"] == "POISON_INPUT"
    assert worker.alive()
    if marker == "@@crash@@":
        assert _metric(metrics_url, "shoal_runtime_restarts") > restarts_before
    assert _metric(metrics_url, "shoal_poison_isolated") >= 1
    ok = httpx.post(f"{stack.url}/v1/encode/{FAULTY}", json={"items": [{"text": "after"}]},
                    timeout=60)
    assert ok.status_code == 200


def _publish(name: str, task_id: str, reply_to: str, **properties) -> None:
    headers = {"task": "shoal.encode", "id": task_id, "shoal_model": DLQ, "shoal_op": "encode",
               "shoal_items": 1, "shoal_cost": 3, "shoal_longest": 3}
    body = msgpack.packb([[], {"model": DLQ, "items": [{"text": "x"}]}, {}])
    with Connection(BROKER_URL) as conn:
        Producer(conn.default_channel).publish(
            body, routing_key=name, exchange="", headers=headers, reply_to=reply_to,
            correlation_id=task_id, content_type="application/x-msgpack",
            content_encoding="binary", **properties)


def test_dead_lettered_requests_get_an_error_reply(stack):
    """Expired and too-often-delivered messages end in the DLQ; a worker answers them."""
    name = queue_name(DLQ)
    reply_to = f"test-dlq-reply-{uuid.uuid4().hex}"
    expired_id, poison_id = str(uuid.uuid4()), str(uuid.uuid4())
    with Connection(BROKER_URL) as conn:
        conn.default_channel.queue_declare(queue=reply_to)
        # Gateways declare a model's queues on its first request, and no worker runs yet:
        # the test declares them itself, as any client of the queue may.
        for queue in kombu_queues(queue_for(DLQ, Settings())):
            queue(conn.default_channel).declare()
    try:
        # No worker serves the model yet: this one expires in the queue.
        _publish(name, expired_id, reply_to, expiration=0.05)
        wait_for(lambda: queue_counts(name + ".dead")[0] == 1, 30, "the expired message")
        # This one is delivered until the delivery limit dead-letters it (a
        # worker that dies on it every time looks the same to the broker).
        _publish(name, poison_id, reply_to)
        with Connection(BROKER_URL) as conn:
            channel = conn.default_channel
            deadline = time.monotonic() + 30
            while queue_counts(name + ".dead")[0] < 2 and time.monotonic() < deadline:
                message = channel.basic_get(name)
                if message is not None:
                    channel.basic_reject(message.delivery_tag, requeue=True)
        assert queue_counts(name + ".dead")[0] == 2

        worker = stack.stack.worker("dlq", [DLQ])
        replies = {}
        with Connection(BROKER_URL) as conn:
            channel = conn.default_channel

            def collect() -> bool:
                message = channel.basic_get(reply_to, no_ack=True)
                if message is not None:
                    reply = msgpack.unpackb(message.body)
                    replies[reply["task_id"]] = reply
                return len(replies) == 2

            wait_for(collect, 120, "answers to both dead letters")
        worker.stop()
        assert replies[expired_id]["status"] == "FAILURE"
        assert replies[expired_id]["result"]["exc_message"][0] == "DEADLINE_EXCEEDED"
        assert replies[poison_id]["result"]["exc_message"][0] == "POISON_INPUT"
        assert queue_counts(name + ".dead")[0] == 0
    finally:
        with Connection(BROKER_URL) as conn:
            conn.default_channel.queue_delete(reply_to)
