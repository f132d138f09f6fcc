"""A worker whose device is fed by two runtime processes (SHOAL_RUNTIME_REPLICAS=2): a
runtime killed under load and a poison request lose nothing and answer each request once;
a deadline and a revoke reach a request held behind both busy runtimes; SIGTERM drains
both and ends both.

Each test runs its own worker on a private queue prefix and talks to the model queue as
a Celery client does (`test_worker_shutdown.Replies`), so every reply is seen, duplicates
included. `test/faulty`'s markers make a batch slow, crash or raise."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAULTY
from tests.e2e.test_worker_shutdown import Replies, _gone, _runtimes
from tests.stack import (
    MeteredWorker,
    PrivateStack,
    private_stack,
    queue_counts,
    start_metered_worker,
    wait_for,
)

pytestmark = pytest.mark.e2e

SLOW = "@@slow@@"


@pytest.fixture
def replies() -> Iterator[Replies]:
    r = Replies()
    yield r
    r.close()


@pytest.fixture
def private(tmp_path: Path) -> Iterator[PrivateStack]:
    with private_stack(tmp_path, "replicas", FAULTY) as stack:
        yield stack


def _worker(private: PrivateStack, name: str, **env: str) -> MeteredWorker:
    env = {"SHOAL_RUNTIME_REPLICAS": "2", "SHOAL_RUNTIME_SPARE": "false", **env}
    return start_metered_worker(private.stack, name, FAULTY, private.queue, 180,
                                SHOAL_QUEUE_PREFIX=private.prefix, **env)


def _error_code(reply: dict) -> str | None:
    return reply["result"]["exc_message"][0] if reply["status"] == "FAILURE" else None


def _both_runtimes_busy(worker: MeteredWorker, replies: Replies, queue: str) -> list[str]:
    """A slow request on each runtime process (the second goes to the one not busy)."""
    slow = []
    for n in (1, 2):
        slow.append(replies.publish(queue, f"{SLOW} slow {n}"))
        wait_for(lambda n=n: worker.metric("shoal_batch_requests_count") >= n, 60,
                 f"slow batch {n} to start")
    return slow


def test_a_runtime_killed_under_load_and_a_poison_request_lose_nothing(private, replies,
                                                                       slow_batches):
    slow_batches.hold()  # the first batch stays in its runtime until after the kill
    worker = _worker(private, "replicas-kill", **slow_batches.env)
    runtimes = _runtimes(worker)
    assert len(runtimes) == 2, runtimes
    queue = private.queue
    ids = [replies.publish(queue, f"{SLOW} first")]
    ids += [replies.publish(queue, f"text {i}") for i in range(30)]
    poison = replies.publish(queue, "bad @@raise@@ text")
    ids += [replies.publish(queue, f"more {i}") for i in range(10)]
    # The kill lands mid-batch: on the runtime where the slow request sleeps (the batch
    # may hold every request, the poison's isolation included, leaving the other idle).
    slow_batches.wait_started(1)
    victim = slow_batches.pids()[0]
    assert victim in runtimes, (victim, runtimes)
    (survivor,) = set(runtimes) - {victim}
    os.kill(victim, signal.SIGKILL)
    slow_batches.release()
    wait_for(lambda: set(replies.by_task()) == {*ids, poison}, 120, "every reply")
    counts = replies.by_task()
    assert all(n == 1 for n in counts.values()), counts
    by_id = {r["task_id"]: r for r in replies.received}
    assert _error_code(by_id[poison]) == "POISON_INPUT"
    assert all(by_id[i]["status"] == "SUCCESS" for i in ids), \
        [by_id[i] for i in ids if by_id[i]["status"] != "SUCCESS"][:3]
    wait_for(lambda: worker.metric("shoal_runtime_restarts") >= 1, 30, "the restart counted")
    after = _runtimes(worker)
    assert len(after) == 2 and victim not in after and survivor in after
    assert worker.process.alive()
    wait_for(lambda: queue_counts(queue) == (0, 1), 30, "the queue to be empty")


def test_a_deadline_and_a_revoke_reach_requests_held_behind_both_runtimes(private, replies,
                                                                          slow_batches):
    from tasks.celery_app import app

    slow_batches.hold()  # both runtimes busy until the deadline was answered
    worker = _worker(private, "replicas-held", SHOAL_RUNTIME_PIPELINE_DEPTH="1",
                     **slow_batches.env)
    queue = private.queue
    slow = _both_runtimes_busy(worker, replies, queue)
    late = replies.publish(queue, "a short deadline",
                           deadline_ms=int(time.time() * 1000) + 1500)
    revoked = replies.publish(queue, "revoked before it runs")
    wait_for(lambda: worker.metric("shoal_held_messages") >= 1, 30, "the requests held")
    app.control.revoke(revoked)
    # The deadline is answered while both slow batches still run.
    reply = wait_for(lambda: replies.of(late), 30, "the late request's answer")
    assert _error_code(reply) == "DEADLINE_EXCEEDED", reply
    assert all(replies.of(s) is None for s in slow)
    slow_batches.release()
    wait_for(lambda: set(replies.by_task()) == {*slow, late, revoked}, 60, "every reply")
    assert _error_code(replies.of(revoked)) == "CANCELLED", replies.of(revoked)
    assert all(replies.of(s)["status"] == "SUCCESS" for s in slow)
    assert all(n == 1 for n in replies.by_task().values())


def test_sigterm_drains_both_runtimes_and_ends_them(private, replies, slow_batches):
    slow_batches.hold()  # both batches run until the held requests went back
    worker = _worker(private, "replicas-drain", SHOAL_RUNTIME_PIPELINE_DEPTH="1",
                     SHOAL_SHUTDOWN_GRACE_S="25", **slow_batches.env)
    queue = private.queue
    runtimes = _runtimes(worker)
    slow = _both_runtimes_busy(worker, replies, queue)
    held = [replies.publish(queue, f"held {i}") for i in range(6)]
    wait_for(lambda: worker.metric("shoal_held_messages") == len(held), 30,
             "the requests held")
    worker.process.kill(signal.SIGTERM)
    wait_for(lambda: queue_counts(queue)[0] == len(held), 10, "the held requests requeued")
    slow_batches.release()
    for s in slow:  # both running batches are answered by the draining worker
        reply = wait_for(lambda s=s: replies.of(s), 30, "a slow request's reply")
        assert reply["status"] == "SUCCESS", reply
    worker.process.reap(30)
    assert worker.process.proc.returncode == 0, worker.process.log()[-3000:]
    wait_for(lambda: _gone(runtimes), 10, "both runtime processes to end")
    assert Counter(replies.by_task()) == Counter(dict.fromkeys(slow, 1))
