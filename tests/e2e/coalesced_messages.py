"""Coalesced messages as a test sends them: straight to a model's queue, as a shoal gateway
would, with every reply of each member read from a reply queue of the test's own (so a
second answer to one request is seen too)."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgpack
from kombu import Connection, Producer

from tasks.catalog import ModelEntry, load_catalog
from tasks.envelope import (
    CONTENT_ENCODING,
    CONTENT_TYPE,
    Part,
    TaskMessage,
    coalesce,
    single_message,
)
from tasks.settings import get_settings
from tests.stack import BROKER_URL, wait_for


def catalog_entry(model: str, catalog_dir: Path | None = None) -> ModelEntry:
    """`model`'s catalog entry (the session's catalog unless another is named)."""
    found = load_catalog(catalog_dir or get_settings().catalog_dir).get(model)
    assert found is not None, f"{model} is not in the catalog"
    return found


def reply_queue() -> str:
    name = f"test-coalesced-reply-{uuid.uuid4().hex}"
    with Connection(BROKER_URL) as conn:
        conn.default_channel.queue_declare(queue=name)
    return name


def send(queue: str, message: TaskMessage, reply_to: str) -> str:
    with Connection(BROKER_URL) as conn:
        Producer(conn.default_channel).publish(
            message.body, routing_key=queue, exchange="", headers=message.headers,
            content_type=CONTENT_TYPE, content_encoding=CONTENT_ENCODING,
            correlation_id=message.task_id, reply_to=reply_to, delivery_mode=2)
    return message.task_id


def publish(queue: str, model: str, parts: list[Part], reply_to: str) -> str:
    """`parts` as one coalesced message, each member answered on its own (not batched)."""
    return send(queue, coalesce(model, parts[0].annotations.op if parts else "encode", parts,
                                "test", reply_batch=False), reply_to)


def publish_alone(queue: str, part: Part, reply_to: str) -> str:
    """`part` as a plain Celery task message of its own."""
    return send(queue, single_message(part, "test", reply_batch=False), reply_to)


def collect(reply_to: str, want: set[str], timeout: float) -> dict[str, list[dict]]:
    """Every reply on `reply_to` by task id, until each of `want` has one."""
    replies: dict[str, list[dict]] = {}
    with Connection(BROKER_URL) as conn:
        channel = conn.default_channel

        def drain() -> bool:
            while (message := channel.basic_get(reply_to, no_ack=True)) is not None:
                reply = msgpack.unpackb(message.body)
                assert message.properties["correlation_id"] == reply["task_id"]
                replies.setdefault(reply["task_id"], []).append(reply)
            return want <= set(replies)

        wait_for(drain, timeout, f"replies to {len(want)} requests")
    return replies


def delete(queue: str) -> None:
    with Connection(BROKER_URL) as conn:
        conn.default_channel.queue_delete(queue)
