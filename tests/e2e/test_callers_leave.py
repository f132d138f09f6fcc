"""Callers that leave release their work (issue 53): an HTTP caller that hangs up before
its answer, and a Celery client that revokes, while the worker's runtime is busy.

One worker of this module's own serves `test/faulty` (the session's queue, behind the
session gateway), one batch at a time, so that requests wait held behind a slow batch
(`@@slow@@`, kept in the model until the test lets it go). A request released at once is
answered (or counted) while that batch still holds the runtime: before issue 53 it was
held until its batch would have formed, and an HTTP request whose caller hung up was
held and then computed for nobody.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import orjson
import pytest

from tasks.envelope import Part, task_part
from tests.conftest import FAULTY, queue_name
from tests.e2e.coalesced_messages import catalog_entry, collect, delete, publish_alone, reply_queue
from tests.slow_batches import SlowBatches
from tests.stack import MeteredWorker, free_port, metric_sum, queue_counts, wait_for

pytestmark = pytest.mark.e2e

SLOW = "@@slow@@"
ABANDONED = 6  # HTTP requests whose callers hang up


@pytest.fixture(scope="module")
def slow_batches(tmp_path_factory: pytest.TempPathFactory) -> SlowBatches:
    return SlowBatches(tmp_path_factory.mktemp("callers-leave-slow"), slow_s=0.0)


@pytest.fixture(scope="module")
def worker(stack, slow_batches: SlowBatches) -> Iterator[MeteredWorker]:
    port = free_port()
    # One batch in flight: the requests wait, held, behind the slow one.
    process = stack.stack.worker(f"callers-leave-{uuid.uuid4().hex[:6]}", [FAULTY],
                                 SHOAL_WORKER_METRICS_PORT=str(port),
                                 SHOAL_RUNTIME_PIPELINE_DEPTH="1", SHOAL_TORCH_THREADS="1",
                                 **slow_batches.env)
    try:
        wait_for(lambda: queue_counts(queue_name(FAULTY))[1] >= 1, 120,
                 f"the worker to consume {FAULTY}", give_up=lambda: not process.alive())
        yield MeteredWorker(process, port)
    finally:
        slow_batches.release()
        process.stop()


@pytest.fixture
def reply_to() -> Iterator[str]:
    name = reply_queue()
    yield name
    delete(name)


def _part(text: str) -> Part:
    return task_part(catalog_entry(FAULTY), {"model": FAULTY, "items": [{"text": text}]},
                     120_000)


def _send_and_stay(gateway_url: str, text: str) -> socket.socket:
    """An HTTP request sent on a connection of its own, its answer not read."""
    address = urlsplit(gateway_url)
    body = orjson.dumps({"items": [{"text": text}]})
    sock = socket.create_connection((address.hostname, address.port), timeout=10)
    sock.sendall(b"POST /v1/encode/%s HTTP/1.1\r\nHost: shoal\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (FAULTY.encode(), len(body), body))
    return sock


def _stall(slow_batches: SlowBatches, reply_to: str) -> str:
    """A slow batch that keeps the runtime busy until `slow_batches.release()`."""
    started = slow_batches.started()
    slow_batches.hold()
    stall = publish_alone(queue_name(FAULTY), _part(f"{SLOW} stall"), reply_to)
    slow_batches.wait_started(started + 1)
    return stall


def test_callers_that_hang_up_are_released_at_once_and_never_computed(
        stack, worker: MeteredWorker, slow_batches: SlowBatches, reply_to: str):
    gateway_metrics = f"{stack.url}/metrics"
    left = metric_sum(gateway_metrics, "shoal_gateway_callers_left_total")
    revoked = worker.metric("shoal_revoked_total")
    batched = worker.metric("shoal_batch_requests_sum")
    try:
        stall = _stall(slow_batches, reply_to)
        running = slow_batches.started()
        callers = [_send_and_stay(stack.url, f"abandoned {i}") for i in range(ABANDONED)]
        wait_for(lambda: worker.metric("shoal_held_messages") == ABANDONED, 30,
                 "the requests to be held behind the slow batch")
        for caller in callers:
            caller.close()
        # Released while the slow batch still holds the runtime: the gateway revoked them
        # and the worker let them go at once.
        wait_for(lambda: worker.metric("shoal_revoked_total") - revoked == ABANDONED
                 and worker.metric("shoal_held_messages") == 0, 30,
                 "the worker to release the abandoned requests")
        assert metric_sum(gateway_metrics, "shoal_gateway_callers_left_total") - left \
            == ABANDONED
        assert slow_batches.started() == running  # the runtime was busy all along
    finally:
        slow_batches.release()
    assert collect(reply_to, {stall}, 60)[stall][0]["status"] == "SUCCESS"
    wait_for(lambda: queue_counts(queue_name(FAULTY))[0] == 0
             and worker.metric("shoal_held_messages") == 0, 30, "everything settled")
    # Only the slow batch ran: none of the abandoned requests reached the runtime.
    assert worker.metric("shoal_batch_requests_sum") - batched == 1


def test_a_celery_revoke_of_a_held_request_is_answered_at_once(
        worker: MeteredWorker, slow_batches: SlowBatches, reply_to: str):
    from tasks.client import encode
    from tasks.errors import ShoalError

    try:
        stall = _stall(slow_batches, reply_to)
        running = slow_batches.started()
        result = encode.delay(model=FAULTY, items=[{"text": "revoked while held"}])
        wait_for(lambda: worker.metric("shoal_held_messages") == 1, 30,
                 "the request to be held behind the slow batch")
        result.revoke()
        # Answered while the slow batch still holds the runtime (it is held for up to
        # 120 s), not when the request's batch would have formed after it.
        with pytest.raises(ShoalError) as err:
            result.get(timeout=30)
        assert err.value.code == "CANCELLED", err.value
        assert "before it ran" in err.value.message
        assert slow_batches.started() == running
    finally:
        slow_batches.release()
    assert collect(reply_to, {stall}, 60)[stall][0]["status"] == "SUCCESS"
