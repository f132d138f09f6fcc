"""Requests that share one broker message (coalesced by the gateway) stay requests of
their own: their own result, error, deadline, Flower task and exactly-once answer."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import replace

import httpx
import numpy as np
import pytest
from kombu import Connection, Consumer, Queue

from app.worker.lifecycle.replies import Delivery, Replier
from tasks.envelope import Part, coalesce, read_coalesced, task_part
from tests.conftest import MINILM, RESTART, queue_name
from tests.e2e.coalesced_messages import catalog_entry as _entry
from tests.e2e.coalesced_messages import collect as _collect
from tests.e2e.coalesced_messages import delete as _delete
from tests.e2e.coalesced_messages import publish as _publish
from tests.e2e.coalesced_messages import reply_queue as _reply_queue
from tests.stack import BROKER_URL, free_port, metric_sum, queue_counts, wait_for

pytestmark = pytest.mark.e2e
# The helpers above keep the names they had when they lived here: test_flower imports
# them from this module.


def test_concurrent_requests_share_messages_and_each_gets_its_own_result(stack):
    url = f"{stack.url}/v1/encode/{MINILM}"
    metrics = f"{stack.url}/metrics"
    results: dict[str, list[float]] = {}

    async def burst(round_: int) -> None:
        texts = [f"coalesced round {round_} text {i}" for i in range(24)]
        async with httpx.AsyncClient(timeout=60) as client:
            responses = await asyncio.gather(
                *(client.post(url, json={"items": [{"text": t}]}) for t in texts))
        for text, response in zip(texts, responses, strict=True):
            assert response.status_code == 200, response.text
            results[text] = response.json()["embeddings"][0]

    def coalesced_once() -> bool:
        # Bursts until some message carried more than one request.
        asyncio.run(burst(len(results)))
        messages = metric_sum(metrics, "shoal_gateway_requests_per_message_count")
        requests = metric_sum(metrics, "shoal_gateway_requests_per_message_sum")
        return requests > messages

    wait_for(coalesced_once, 120, "a message carrying several requests", interval=0)
    # Each got the embedding of its own text: the same as asked alone.
    for text in list(results)[:: max(1, len(results) // 6)]:
        alone = httpx.post(url, json={"items": [{"text": text}]}, timeout=60).json()
        assert np.dot(alone["embeddings"][0], results[text]) >= 0.9999


def test_each_request_of_a_coalesced_message_keeps_its_deadline_and_errors(stack):
    entry = _entry(MINILM)
    good = task_part(entry, {"model": MINILM, "items": [{"text": "fine"}]}, 30_000)
    bad = task_part(entry, {"model": MINILM, "items": [{"text": 42}]}, 30_000)
    late = task_part(entry, {"model": MINILM, "items": [{"text": "too late"}]}, 30_000)
    late = replace(late, annotations=replace(late.annotations,
                                             deadline_ms=int(time.time() * 1000) - 1000))
    reply_to = _reply_queue()
    try:
        _publish(queue_name(MINILM), MINILM, [good, bad, late], reply_to)
        replies = _collect(reply_to, {good.task_id, bad.task_id, late.task_id}, 60)
    finally:
        _delete(reply_to)
    assert replies[good.task_id][0]["status"] == "SUCCESS"
    assert replies[good.task_id][0]["result"]["count"] == 1
    assert replies[bad.task_id][0]["result"]["exc_message"][0] == "VALIDATION_ERROR"
    assert replies[late.task_id][0]["result"]["exc_message"][0] == "DEADLINE_EXCEEDED"
    assert all(len(r) == 1 for r in replies.values())
    wait_for(lambda: queue_counts(queue_name(MINILM))[0] == 0, 30, "the message to be acked")


def test_a_coalesced_message_redelivered_after_its_worker_dies_is_answered_once(stack):
    """The worker dies (kill -9) while the message's batch runs; another worker gets the
    message again and answers each request, once."""
    metrics_port = free_port()
    slow = stack.stack.worker(f"coalesced-slow-{uuid.uuid4().hex[:6]}", [RESTART],
                              SHOAL_RUNTIME="sim", SHOAL_SIM_COST_A_MS="60000",
                              SHOAL_SIM_COST_B_US="0", SHOAL_SIM_COST_C_NS="0",
                              SHOAL_WORKER_METRICS_PORT=str(metrics_port))
    queue = queue_name(RESTART)
    reply_to = _reply_queue()
    entry = _entry(RESTART)
    parts = [task_part(entry, {"model": RESTART, "items": [{"text": f"redelivered {i}"}]},
                       300_000) for i in range(3)]
    try:
        wait_for(lambda: queue_counts(queue)[1] >= 1, 120, "the slow worker to consume")
        _publish(queue, RESTART, parts, reply_to)
        # The slow worker runs the three requests in a batch of a minute.
        wait_for(lambda: metric_sum(f"http://127.0.0.1:{metrics_port}/metrics",
                                     "shoal_batch_requests_sum") == 3,
                 30, "the slow worker to start the batch")
        slow.kill()
        slow.reap(10)
        fast = stack.stack.worker(f"coalesced-fast-{uuid.uuid4().hex[:6]}", [RESTART],
                                  SHOAL_RUNTIME="sim", SHOAL_SIM_COST_A_MS="0",
                                  SHOAL_SIM_COST_B_US="0", SHOAL_SIM_COST_C_NS="0")
        replies = _collect(reply_to, {p.task_id for p in parts}, 120)
        fast.stop()
    finally:
        _delete(reply_to)
        if slow.alive():
            slow.kill()
    assert {t: [r["status"] for r in rs] for t, rs in replies.items()} == {
        p.task_id: ["SUCCESS"] for p in parts}
    assert queue_counts(queue)[0] == 0


def test_returned_requests_of_a_coalesced_message_are_republished_then_acked(stack):
    """A message cannot be requeued in part: the returned requests go out again as a
    message of their own, and the original is acked once that is confirmed and the
    request that stayed is answered."""
    queue = f"test-coalesced-returns-{uuid.uuid4().hex}"
    entry = _entry(MINILM)
    parts = [task_part(entry, {"model": MINILM, "items": [{"text": f"t{i}"}]}, 30_000)
             for i in range(3)]
    with Connection(BROKER_URL) as conn:
        channel = conn.channel()
        Queue(queue, channel=channel).declare()
        try:
            _publish(queue, MINILM, parts, "nobody")
            received = []
            consumer = Consumer(channel, queues=[Queue(queue)], accept=["msgpack"],
                                on_message=received.append, prefetch_count=1)
            consumer.consume()
            wait_for(lambda: _drain(conn) or received, 10, "the message")
            message = received[0]
            replier = Replier(object())
            replier.open(conn)
            delivery = Delivery(message, 3)
            kept, *returned = read_coalesced(message.headers, message.body)
            again = coalesce(MINILM, "encode", [Part(p.task_id, p.annotations, p.body,
                                                     p.returns + 1) for p in returned], "test")
            replier.forward([delivery, delivery], queue, again.body, again.headers, 30)
            wait_for(lambda: _drain(conn) or delivery.open == 1, 10, "the confirm")
            assert not delivery.closed  # `kept` is not settled yet
            consumer.cancel()  # so the republished message stays in the queue
            delivery.settle()
            assert delivery.closed
            republished = wait_for(lambda: channel.basic_get(queue, no_ack=True), 10,
                                   "the republished requests")
            read = read_coalesced(republished.headers, republished.body)
            assert [p.task_id for p in read] == [p.task_id for p in returned]
            assert all(p.returns == 1 for p in read)
            assert kept.task_id == parts[0].task_id
            # The original was acked: nothing else is left in the queue.
            assert channel.basic_get(queue, no_ack=True) is None
        finally:
            channel.queue_delete(queue)


def _drain(conn: Connection) -> None:
    with contextlib.suppress(TimeoutError):
        conn.drain_events(timeout=0.2)
