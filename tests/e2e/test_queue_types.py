"""A model's catalog entry picks its queue's type (`queue_type`): one worker serves a model
on a classic queue and one on a quorum queue, the gateway and the worker declare each with
its entry's type, and when the worker is killed mid-batch (SIGKILL, its runtime with it)
the unacked requests of both queues go back to them and its successor answers every one.

A private stack: its own queue prefix and catalog folder (the two entries), the
`dense-faulty` adapter on the tiny model's weights, whose @@slow@@ marker keeps the first
worker's batch running (SHOAL_FAULTY_SLOW_S) until the kill.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from kombu import Connection

from app.tuning.stack import prefix_queues
from tasks.settings import Settings
from tasks.topology import QueueType, queue_for
from tests.conftest import TINY_CLS_DIR
from tests.stack import (
    BROKER_URL,
    Process,
    Stack,
    delete_queues,
    free_port,
    http_status,
    queue_counts,
    wait_for,
)

pytestmark = pytest.mark.e2e

CLASSIC = "test/qt-classic"  # its entry says queue_type: classic
QUORUM = "test/qt-quorum"  # its entry says nothing: SHOAL_QUEUE_TYPE, quorum here
TYPES: dict[str, QueueType] = {CLASSIC: "classic", QUORUM: "quorum"}
PER_MODEL = 5  # requests to each model
SLOW = "@@slow@@"


class Private:
    def __init__(self, tmp_path: Path) -> None:
        self.prefix = f"shoal-qtypes-{uuid.uuid4().hex[:8]}"
        catalog = tmp_path / "catalog"
        catalog.mkdir()
        for model, extra in ((CLASSIC, {"queue_type": "classic"}), (QUORUM, {})):
            entry = {"id": model, "adapter": "dense-faulty", "source": {"path": str(TINY_CLS_DIR)},
                     "dims": 32, **extra}
            (catalog / f"{model.split('/')[1]}.yaml").write_text(yaml.safe_dump(entry))
        logs = tmp_path / "logs"
        logs.mkdir()
        # Each request is a message of its own (no coalescing): the test counts them.
        self.stack = Stack({**os.environ, "SHOAL_QUEUE_PREFIX": self.prefix,
                            "SHOAL_CATALOG_DIR": str(catalog), "SHOAL_QUEUE_TYPE": "quorum",
                            "SHOAL_COALESCE": "false"}, logs)
        self.settings = Settings(queue_prefix=self.prefix)
        self.queues = {m: queue_for(m, self.settings).name for m in TYPES}  # names only
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def worker(self, name: str, slow_s: float) -> tuple[Process, str]:
        """A worker serving both models (one batch in flight), and its /metrics URL."""
        port = free_port()
        process = self.stack.worker(f"{name}-{uuid.uuid4().hex[:6]}", list(TYPES),
                                    SHOAL_WORKER_METRICS_PORT=str(port),
                                    SHOAL_RUNTIME_PIPELINE_DEPTH="1",
                                    SHOAL_FAULTY_SLOW_S=str(slow_s))
        return process, f"http://127.0.0.1:{port}/metrics"

    def consumed(self, process: Process, what: str) -> None:
        wait_for(lambda: all(queue_counts(q)[1] >= 1 for q in self.queues.values()), 120,
                 f"{what} to consume both queues",
                 give_up=lambda: None if process.alive() else f"{what} exited")


@pytest.fixture
def private(tmp_path: Path) -> Iterator[Private]:
    private = Private(tmp_path)
    try:
        yield private
    except BaseException:
        private.stack.print_logs()
        raise
    finally:
        private.stack.stop_all()
        delete_queues(prefix_queues(private.prefix, TYPES))


def type_on_broker(name: str, model: str, settings: Settings) -> str:
    """The queue's type as the broker has it: a declaration with every argument of one type
    is a no-op where the queue is of that type, and is refused naming the type it has
    where it is of the other."""
    with Connection(BROKER_URL) as conn:
        for kind in ("quorum", "classic"):
            channel = conn.channel()
            try:
                channel.queue_declare(queue=name, durable=True, auto_delete=False,
                                      arguments=queue_for(model, settings, kind).arguments)
                return kind
            except Exception as refused:  # the channel is closed by the refusal
                assert "inequivalent arg 'x-queue-type'" in str(refused), refused
    raise AssertionError(f"{name}: neither a quorum nor a classic queue of shoal's arguments")


def metric(url: str, name: str, model: str) -> float:
    """One model's sample of a worker's metric (0 before the model has one)."""
    label = f'model="{model}"'
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def encode(url: str, model: str, i: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/encode/{model}", json={"items": [{"text": f"{SLOW} {i}"}]},
                      headers={"x-timeout-ms": "120000"}, timeout=150)


def test_each_models_queue_has_its_entrys_type_and_a_kill_loses_nothing(private):
    first, metrics = private.worker("qtypes-a", slow_s=300)
    gateway = private.stack.gateway("gateway", private.port, list(TYPES))
    wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 60, "the gateway",
             give_up=lambda: None if gateway.alive() else "the gateway exited")
    private.consumed(first, "the first worker")
    for model, kind in TYPES.items():
        assert type_on_broker(private.queues[model], model, private.settings) == kind, model

    with ThreadPoolExecutor(2 * PER_MODEL) as pool:
        calls: list[tuple[str, Future[httpx.Response]]] = [
            (model, pool.submit(encode, private.url, model, i))
            for i in range(PER_MODEL) for model in TYPES]

        # Every request reached the worker (none ready in the queues, each one in its
        # running batch or held behind it, unacked) and one batch runs: kill it there.
        def all_unacked_on_the_worker() -> bool:
            started = sum(metric(metrics, "shoal_batch_requests_sum", m) for m in TYPES)
            held = sum(metric(metrics, "shoal_held_messages", m) for m in TYPES)
            return started >= 1 and started + held == 2 * PER_MODEL \
                and all(queue_counts(q)[0] == 0 for q in private.queues.values())

        def answered_early() -> str | None:  # a refused declaration answers 503 at once
            if not first.alive():
                return "the worker exited"
            done = [(m, c.result().text) for m, c in calls if c.done() and not c.exception()]
            return f"answered before the kill: {done}" if done else None

        wait_for(all_unacked_on_the_worker, 60, "the worker to hold every request",
                 interval=0.2, give_up=answered_early)
        first.kill()  # SIGKILL, to its process group: the runtime goes with it
        first.reap(10)

        # Both queues take their unacked messages back, the classic one too.
        for model, queue in private.queues.items():
            wait_for(lambda q=queue: queue_counts(q) == (PER_MODEL, 0), 30,
                     f"the requests of {model} back in its queue")

        second, _ = private.worker("qtypes-b", slow_s=0.05)
        private.consumed(second, "the second worker")  # its declarations were accepted
        for model, call in calls:
            response = call.result(120)
            assert response.status_code == 200, (model, response.text)
            assert len(response.json()["embeddings"]) == 1
    for model, kind in TYPES.items():
        assert type_on_broker(private.queues[model], model, private.settings) == kind, model
    assert all(queue_counts(q)[0] == 0 for q in private.queues.values())
