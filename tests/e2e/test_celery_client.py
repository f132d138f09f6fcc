"""Backend services call shoal as Celery tasks and get what HTTP callers get."""

from __future__ import annotations

import time
import uuid

import httpx
import msgpack
import numpy as np
import pytest
from kombu import Connection, Producer

from tests.conftest import MINILM, queue_name
from tests.stack import BROKER_URL, wait_for

pytestmark = pytest.mark.e2e


def test_celery_client_gets_the_http_result(stack):
    from tasks.client import embedding_rows, encode

    texts = ["The cat sits on the mat.", "Grüße 東京"]
    result = encode.apply_async(
        kwargs={"model": MINILM, "items": [{"text": t} for t in texts]}
    ).get(timeout=30)
    assert result["count"] == 2 and result["dims"] == 384 and result["dtype"] == "float32"
    via_celery = np.array(embedding_rows(result), dtype=np.float32)
    r = httpx.post(f"{stack.url}/v1/encode/{MINILM}",
                   json={"items": [{"text": t} for t in texts]}, timeout=30)
    via_http = np.array(r.json()["embeddings"], dtype=np.float32)
    np.testing.assert_array_equal(via_celery, via_http)


def test_send_task_and_delay_forms(stack):
    from tasks.client import app, encode

    a = app.send_task("shoal.encode", kwargs={"model": MINILM, "items": [{"text": "x"}]})
    b = encode.delay(model=MINILM, items=[{"text": "x"}])
    assert a.get(timeout=30)["embeddings"] == b.get(timeout=30)["embeddings"]


def test_celery_client_sees_shoal_errors(stack):
    from tasks.client import encode
    from tasks.errors import ShoalError

    with pytest.raises(ShoalError) as err:
        encode.delay(model=MINILM, items=[{"text": 42}]).get(timeout=30)
    assert err.value.code == "VALIDATION_ERROR" and "items[0]" in err.value.message


def _publish_raw(headers: dict, body: bytes, reply_to: str, task_id: str) -> None:
    with Connection(BROKER_URL) as conn:
        Producer(conn.default_channel).publish(
            body, routing_key=queue_name(MINILM), exchange="", headers=headers,
            content_type="application/x-msgpack", content_encoding="binary",
            correlation_id=task_id, reply_to=reply_to,
        )


def _await_reply(reply_to: str, task_id: str) -> dict:
    with Connection(BROKER_URL) as conn:
        channel = conn.default_channel
        message = wait_for(lambda: channel.basic_get(reply_to, no_ack=True), 30, "the reply")
        channel.queue_delete(reply_to)
    assert message.properties["correlation_id"] == task_id
    return msgpack.unpackb(message.body)


@pytest.mark.parametrize("case", ["deadline_passed", "undecodable_body"])
def test_worker_answers_instead_of_dropping(stack, case):
    """A message the worker cannot run still gets an error reply, and is acked."""
    task_id, reply_to = str(uuid.uuid4()), f"test-reply-{uuid.uuid4().hex}"
    with Connection(BROKER_URL) as conn:
        conn.default_channel.queue_declare(queue=reply_to)
    headers = {"task": "shoal.encode", "id": task_id, "shoal_model": MINILM,
               "shoal_op": "encode", "shoal_items": 1, "shoal_cost": 3, "shoal_longest": 3}
    body = msgpack.packb([[], {"model": MINILM, "items": [{"text": "x"}]}, {}])
    if case == "deadline_passed":
        headers["shoal_deadline"] = int(time.time() * 1000) - 1000
        expected = "DEADLINE_EXCEEDED"
    else:
        body = b"\xc1 not msgpack"
        expected = "INVALID_REQUEST"
    _publish_raw(headers, body, reply_to, task_id)
    reply = _await_reply(reply_to, task_id)
    assert reply["status"] == "FAILURE"
    assert reply["result"]["exc_type"] == "ShoalError"
    assert reply["result"]["exc_message"][0] == expected


@pytest.mark.parametrize("model, status, code", [(MINILM, "SUCCESS", None),
                                                  ("nobody/knows", "FAILURE", "MODEL_NOT_FOUND")])
def test_a_message_without_shoal_headers_is_annotated_by_the_worker(stack, model, status, code):
    """A Celery client whose publish hook could not annotate (no catalog at hand) still
    gets its answer: the worker estimates the request from the model's catalog entry."""
    task_id, reply_to = str(uuid.uuid4()), f"test-reply-{uuid.uuid4().hex}"
    with Connection(BROKER_URL) as conn:
        conn.default_channel.queue_declare(queue=reply_to)
    headers = {"task": "shoal.encode", "id": task_id}
    body = msgpack.packb([[], {"model": model, "items": [{"text": "no headers"}]}, {}])
    _publish_raw(headers, body, reply_to, task_id)
    reply = _await_reply(reply_to, task_id)
    assert reply["status"] == status, reply
    if code is None:
        assert reply["result"]["count"] == 1
    else:
        assert reply["result"]["exc_message"][0] == code
