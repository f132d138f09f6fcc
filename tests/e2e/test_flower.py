"""Operators see the worker, each request as a task, and the model queues in Flower."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tasks.envelope import task_part
from tests.conftest import MAIN_WORKER, MINILM, queue_name
from tests.stack import free_port, wait_for

pytestmark = pytest.mark.e2e


def test_flower_lists_worker_tasks_and_queues(stack):
    from tasks.client import encode

    port = free_port()
    stack.stack.flower("flower", port)
    url = f"http://127.0.0.1:{port}"

    def workers() -> dict:
        return httpx.get(f"{url}/api/workers", params={"refresh": "true"}, timeout=10).json()

    names = wait_for(lambda: [w for w in workers() if w.startswith(f"{MAIN_WORKER}@")], 60,
                     "Flower to list the worker")

    def task_seen() -> dict | None:
        # Flower sees only events sent after it connected: send until one shows up.
        task_id = str(uuid.uuid4())
        encode.apply_async(kwargs={"model": MINILM, "items": [{"text": "x"}]},
                           task_id=task_id).get(timeout=30)
        return wait_for(lambda: httpx.get(f"{url}/api/task/info/{task_id}").json(), 5,
                        "the task in Flower")

    wait_for(task_seen, 60, "Flower to receive task events", interval=0.5)

    ids = [str(uuid.uuid4()) for _ in range(3)]
    for task_id in ids:
        encode.apply_async(kwargs={"model": MINILM, "items": [{"text": task_id}]},
                           task_id=task_id).get(timeout=30)

    def finished() -> list[dict]:
        infos = [httpx.get(f"{url}/api/task/info/{t}").json() for t in ids]
        return infos if all(i.get("state") == "SUCCESS" for i in infos) else []

    for info in wait_for(finished, 30, "the tasks to show as succeeded"):
        assert info["name"] == "shoal.encode"
        assert info["worker"] == names[0]
        assert info["runtime"] is not None and info["runtime"] >= 0
        assert info["received"] and info["started"] and info["succeeded"]

    broker_page = wait_for(
        lambda: (page := httpx.get(f"{url}/broker", timeout=10).text)
        and queue_name(MINILM) in page and page, 30, "the model queue on the broker tab")
    assert queue_name(MINILM) in broker_page


def test_flower_shows_each_request_of_a_coalesced_message(stack):
    """Requests that shared one broker message are one Flower task each."""
    from tests.e2e.test_coalescing import _collect, _delete, _entry, _publish, _reply_queue

    port = free_port()
    stack.stack.flower("flower-coalesced", port)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: [w for w in httpx.get(f"{url}/api/workers", params={"refresh": "true"},
                                           timeout=10).json() if w.startswith(f"{MAIN_WORKER}@")],
             60, "Flower to list the worker")
    entry = _entry(MINILM)
    reply_to = _reply_queue()

    def shown() -> list[dict]:
        # Flower sees only events sent after it connected: publish until they show up.
        parts = [task_part(entry, {"model": MINILM, "items": [{"text": f"flower {i}"}]},
                           30_000) for i in range(3)]
        _publish(queue_name(MINILM), MINILM, parts, reply_to)
        _collect(reply_to, {p.task_id for p in parts}, 30)

        def succeeded() -> list[dict]:
            infos = [httpx.get(f"{url}/api/task/info/{p.task_id}").json() for p in parts]
            return infos if all(i.get("state") == "SUCCESS" for i in infos) else []

        return wait_for(succeeded, 5, "the requests in Flower")

    try:
        infos = wait_for(shown, 60, "Flower to show the coalesced requests", interval=0.5)
    finally:
        _delete(reply_to)
    assert len({i["uuid"] for i in infos}) == 3
    for info in infos:
        assert info["name"] == "shoal.encode" and info["runtime"] is not None
        assert info["received"] and info["started"] and info["succeeded"]
