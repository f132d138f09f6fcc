"""Operators see the worker, each request as a task, and the model queues in Flower, which
is behind basic auth (its credentials on no command line)."""

from __future__ import annotations

import secrets
import uuid
from pathlib import Path

import httpx
import pytest

from tasks.envelope import task_part
from tests.conftest import MAIN_WORKER, MINILM, queue_name
from tests.stack import free_port, wait_for

pytestmark = pytest.mark.e2e


def _flower(stack, name: str) -> tuple[str, httpx.Client]:
    """A Flower of the test's own, and a client with its credentials."""
    port = free_port()
    password = secrets.token_urlsafe(16)
    stack.stack.flower(name, port, password=password)
    url = f"http://127.0.0.1:{port}"
    return url, httpx.Client(auth=("shoal", password), timeout=10)


def test_flower_asks_for_its_password_and_keeps_secrets_off_its_command_line(stack):
    port = free_port()
    password = secrets.token_urlsafe(16)
    management_url = "http://guest:guest@127.0.0.1:15672/api/"
    process = stack.stack.flower("flower-auth", port, management_url, password)
    url = f"http://127.0.0.1:{port}"
    status = wait_for(lambda: httpx.get(f"{url}/api/workers", timeout=5).status_code, 60,
                      "Flower to answer", give_up=lambda: None if process.alive() else "exited")
    assert status == 401
    for path in ("/", "/broker", "/api/tasks"):
        assert httpx.get(f"{url}{path}", timeout=5).status_code == 401, path
        assert httpx.get(f"{url}{path}", auth=("shoal", "wrong"), timeout=5).status_code == 401
        assert httpx.get(f"{url}{path}", auth=("shoal", password),
                         timeout=10).status_code == 200, path
    # `shoal flower` became Flower (exec): its command line is all `ps` shows.
    cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
    assert "flower" in cmdline
    assert password not in cmdline and "guest:guest" not in cmdline


def test_flower_lists_worker_tasks_and_queues(stack):
    from tasks.client import encode

    url, http = _flower(stack, "flower")

    def workers() -> dict:
        return http.get(f"{url}/api/workers", params={"refresh": "true"}).json()

    names = wait_for(lambda: [w for w in workers() if w.startswith(f"{MAIN_WORKER}@")], 60,
                     "Flower to list the worker")

    def task_seen() -> dict | None:
        # Flower sees only events sent after it connected: send until one shows up.
        task_id = str(uuid.uuid4())
        encode.apply_async(kwargs={"model": MINILM, "items": [{"text": "x"}]},
                           task_id=task_id).get(timeout=30)
        return wait_for(lambda: http.get(f"{url}/api/task/info/{task_id}").json(), 5,
                        "the task in Flower")

    wait_for(task_seen, 60, "Flower to receive task events", interval=0.5)

    ids = [str(uuid.uuid4()) for _ in range(3)]
    for task_id in ids:
        encode.apply_async(kwargs={"model": MINILM, "items": [{"text": task_id}]},
                           task_id=task_id).get(timeout=30)

    def finished() -> list[dict]:
        infos = [http.get(f"{url}/api/task/info/{t}").json() for t in ids]
        return infos if all(i.get("state") == "SUCCESS" for i in infos) else []

    for info in wait_for(finished, 30, "the tasks to show as succeeded"):
        assert info["name"] == "shoal.encode"
        assert info["worker"] == names[0]
        assert info["runtime"] is not None and info["runtime"] >= 0
        assert info["received"] and info["started"] and info["succeeded"]

    broker_page = wait_for(
        lambda: (page := http.get(f"{url}/broker").text)
        and queue_name(MINILM) in page and page, 30, "the model queue on the broker tab")
    assert queue_name(MINILM) in broker_page


def test_flower_shows_each_request_of_a_coalesced_message(stack):
    """Requests that shared one broker message are one Flower task each."""
    from tests.e2e.test_coalescing import _collect, _delete, _entry, _publish, _reply_queue

    url, http = _flower(stack, "flower-coalesced")
    wait_for(lambda: [w for w in http.get(f"{url}/api/workers", params={"refresh": "true"}
                                          ).json() if w.startswith(f"{MAIN_WORKER}@")],
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
            infos = [http.get(f"{url}/api/task/info/{p.task_id}").json() for p in parts]
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
