"""SIGTERM drains a worker: what has not started goes back to the queue at once, the
running batch is answered (not run again elsewhere), then the worker exits; a second
SIGTERM, or the grace running out, ends it as a crash would and nothing is lost.

Each test runs its own workers on a private queue prefix and talks to the model queue
as a Celery client does: plain task messages, replies on a queue of the test's own, so
every reply is seen, duplicates included. The `test/faulty` model's @@slow@@ marker
makes one batch run long (SHOAL_FAULTY_SLOW_S) while the other requests wait, held.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from kombu import Connection, Producer

from tests.conftest import FAULTY
from tests.stack import (
    BROKER_URL,
    MeteredWorker,
    PrivateStack,
    private_stack,
    queue_counts,
    start_metered_worker,
    wait_for,
)

pytestmark = pytest.mark.e2e

SLOW = "@@slow@@"
HELD = 24  # requests held behind the slow one


class Replies:
    """A reply queue of the test's own, and every reply that came to it."""

    def __init__(self) -> None:
        self.name = f"test-shutdown-reply-{uuid.uuid4().hex}"
        self.conn = Connection(BROKER_URL)
        self.channel = self.conn.channel()
        self.channel.queue_declare(queue=self.name)
        self.received: list[dict] = []

    def publish(self, queue: str, *texts: str, task_id: str | None = None,
                deadline_ms: int | None = None) -> str:
        """A request for `texts`; with a deadline (epoch ms) as the gateway sends one: the
        broker dead-letters it (which a worker answers) once it passes in the queue."""
        task_id = task_id or str(uuid.uuid4())
        headers = {"task": "shoal.encode", "id": task_id, "shoal_model": FAULTY,
                   "shoal_op": "encode", "shoal_items": len(texts),
                   "shoal_cost": 8 * len(texts), "shoal_longest": 8}
        expiration = None
        if deadline_ms is not None:
            headers["shoal_deadline"] = deadline_ms
            expiration = max(0.0, deadline_ms / 1000 - time.time())
        body = msgpack.packb([[], {"model": FAULTY, "items": [{"text": t} for t in texts]},
                              {}])
        Producer(self.channel).publish(
            body, routing_key=queue, exchange="", headers=headers, reply_to=self.name,
            correlation_id=task_id, content_type="application/x-msgpack",
            content_encoding="binary", delivery_mode=2, expiration=expiration)
        return task_id

    def collect(self) -> None:
        while (message := self.channel.basic_get(self.name, no_ack=True)) is not None:
            self.received.append(msgpack.unpackb(message.body))

    def by_task(self) -> Counter[str]:
        self.collect()
        return Counter(reply["task_id"] for reply in self.received)

    def of(self, task_id: str) -> dict | None:
        self.collect()
        return next((r for r in self.received if r["task_id"] == task_id), None)

    def close(self) -> None:
        self.channel.queue_delete(self.name)
        self.conn.close()


@pytest.fixture
def replies() -> Iterator[Replies]:
    r = Replies()
    yield r
    r.close()


@pytest.fixture
def private(tmp_path: Path) -> Iterator[PrivateStack]:
    with private_stack(tmp_path, "shutdown", FAULTY) as stack:
        yield stack


def _worker(private: PrivateStack, name: str, **env: str) -> MeteredWorker:
    # One batch in flight: these tests count what is held behind the slow batch. With a
    # pipelined runtime (depth 2) requests that arrive as the slow batch nears its
    # predicted end start a second batch, queued in the runtime, and are not held.
    env = {"SHOAL_RUNTIME_PIPELINE_DEPTH": "1", **env}
    return start_metered_worker(private.stack, name, FAULTY, private.queue, 120,
                                SHOAL_QUEUE_PREFIX=private.prefix, **env)


def _runtimes(worker: MeteredWorker) -> list[int]:
    """The worker's model runtime processes (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == worker.process.pid \
                and b"runtimes.child_side.server" in cmdline:
            found.append(int(entry.name))
    assert found, "the worker has no runtime process"
    return found


def _hold_behind_a_slow_batch(worker: MeteredWorker, replies: Replies, queue: str,
                              held: int) -> tuple[str, list[str]]:
    """One slow request running on `worker`, `held` more held there behind it."""
    slow = replies.publish(queue, f"{SLOW} the long batch")
    wait_for(lambda: worker.metric("shoal_batch_requests_count") >= 1, 60,
             "the slow batch to start")
    rest = [replies.publish(queue, f"request {i}") for i in range(held)]
    seen: list[tuple[float, int]] = []

    def holds_them() -> bool:
        seen[:] = [(worker.metric("shoal_held_messages"), queue_counts(queue)[0])]
        return seen[0] == (held, 0)

    try:
        wait_for(holds_them, 60, f"the worker to hold {held} requests")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last (held, ready in the queue): {seen}") from None
    return slow, rest


def _gone(pids: list[int]) -> bool:
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_sigterm_hands_back_the_held_and_answers_the_running_batch(private, replies,
                                                                    slow_batches):
    queue = private.queue
    slow_batches.hold()  # in the model until the test has seen the drain begin
    a = _worker(private, "drain-a", SHOAL_SHUTDOWN_GRACE_S="25", **slow_batches.env)
    slow, rest = _hold_behind_a_slow_batch(a, replies, queue, HELD)
    runtimes = _runtimes(a)

    a.process.kill(signal.SIGTERM)
    # Handed back at once, while the slow batch still runs; and nothing more comes to it
    # (a cancelled consumer of a quorum queue is still counted while it holds unacked
    # messages: what it is sent, and hands back, says whether it still consumes).
    alive = lambda: None if a.process.alive() else "the worker exited first"  # noqa: E731
    wait_for(lambda: queue_counts(queue)[0] == HELD, 10, "the held requests requeued",
             give_up=alive)
    later = [replies.publish(queue, f"after the signal {i}") for i in range(4)]
    wait_for(lambda: queue_counts(queue)[0] == HELD + len(later), 10,
             "the later requests to stay queued", give_up=alive)
    assert a.metric("shoal_worker_draining") == 1
    assert a.metric("shoal_shutdown_handed_back_total") == HELD
    assert a.metric("shoal_batch_requests_sum") == 1  # it ran the slow request only
    assert replies.of(slow) is None  # still running
    slow_batches.release()

    # The running batch is answered by the draining worker, then it exits cleanly.
    reply = wait_for(lambda: replies.of(slow), 30, "the slow request's reply")
    assert reply["status"] == "SUCCESS", reply
    assert reply["result"]["worker"].startswith("drain-a-")
    a.process.reap(30)
    assert a.process.proc.returncode == 0, a.process.log()[-3000:]
    log = a.process.log()
    assert "draining for shutdown" in log and "drained in" in log, log[-3000:]
    wait_for(lambda: _gone(runtimes), 10, "the runtime process to end")

    # Another worker answers the requests handed back, each once; it never runs the slow one.
    b = _worker(private, "drain-b", SHOAL_FAULTY_SLOW_S="8")
    others = [*rest, *later]
    wait_for(lambda: set(replies.by_task()) == {slow, *others}, 60, "every reply")
    wait_for(lambda: b.metric("shoal_results_total") == len(others), 30, "b's results")
    wait_for(lambda: queue_counts(queue) == (0, 1), 30, "the queue to be empty")
    counts = replies.by_task()
    assert all(n == 1 for n in counts.values()), counts
    assert all(r["status"] == "SUCCESS" for r in replies.received)
    assert {r["result"]["worker"][:8] for r in replies.received
            if r["task_id"] != slow} == {"drain-b-"}
    assert b.metric("shoal_batch_requests_sum") == len(others)  # nothing computed twice


@pytest.mark.parametrize("end", ["second-sigterm", "grace-runs-out"])
def test_a_forced_end_loses_nothing(private, replies, end):
    queue = private.queue
    grace = "60" if end == "second-sigterm" else "2"
    a = _worker(private, "force-a", SHOAL_FAULTY_SLOW_S="300", SHOAL_SHUTDOWN_GRACE_S=grace)
    held = 8
    slow, rest = _hold_behind_a_slow_batch(a, replies, queue, held)
    runtimes = _runtimes(a)

    a.process.kill(signal.SIGTERM)
    wait_for(lambda: queue_counts(queue)[0] == held, 10, "the held requests requeued",
             give_up=lambda: None if a.process.alive() else "the worker exited first")
    assert a.metric("shoal_shutdown_handed_back_total") == held
    if end == "second-sigterm":
        assert a.process.alive()  # a 300 s batch and a 60 s grace: still draining
        a.process.kill(signal.SIGTERM)
    # A stalled batch does not hold the exit up: the worker and its runtime end, and the
    # stalled request goes back to the queue (unacked), as after a crash.
    a.process.reap(30)
    assert a.process.proc.returncode == 1, a.process.log()[-3000:]
    assert "shutdown forced" in a.process.log(), a.process.log()[-3000:]
    wait_for(lambda: _gone(runtimes), 10, "the runtime process to end")
    assert replies.by_task() == Counter()
    wait_for(lambda: queue_counts(queue) == (held + 1, 0), 30, "the slow request redelivered")

    b = _worker(private, "force-b", SHOAL_FAULTY_SLOW_S="0.1")
    wait_for(lambda: set(replies.by_task()) == {slow, *rest}, 60, "every reply")
    wait_for(lambda: queue_counts(queue) == (0, 1), 30, "the queue to be empty")
    counts = replies.by_task()
    assert all(n == 1 for n in counts.values()), counts
    assert all(r["status"] == "SUCCESS" for r in replies.received), replies.received
    assert b.metric("shoal_batch_requests_sum") == held + 1  # each run once more, no more


def test_a_split_request_that_started_is_finished(private, replies, slow_batches):
    """A request run in parts whose first part runs when SIGTERM comes gets all its parts
    run and is answered; the requests held behind it go back."""
    queue = private.queue
    # A batch of at most 12 tokens: a request of 4 texts of 8 runs as 4 parts (one batch in
    # flight, as every worker here: see _worker).
    slow_batches.hold()  # the first part runs until the held requests went back
    a = _worker(private, "split-a", SHOAL_BATCH_MAX_TOKENS="12", **slow_batches.env)
    split = replies.publish(queue, f"{SLOW} first", "second", "third", "fourth")
    wait_for(lambda: a.metric("shoal_split_requests_total") == 1
             and a.metric("shoal_batch_requests_count") >= 1, 60, "its first part to run")
    held = [replies.publish(queue, f"request {i}") for i in range(6)]
    wait_for(lambda: a.metric("shoal_held_messages") == len(held)
             and queue_counts(queue)[0] == 0, 60, "the worker to hold the others")

    a.process.kill(signal.SIGTERM)
    wait_for(lambda: queue_counts(queue)[0] == len(held), 10, "the others requeued",
             give_up=lambda: None if a.process.alive() else "the worker exited first")
    slow_batches.release()
    reply = wait_for(lambda: replies.of(split), 30, "the split request's reply")
    assert reply["status"] == "SUCCESS", reply
    assert reply["result"]["count"] == 4
    assert reply["result"]["worker"].startswith("split-a-")
    a.process.reap(30)
    assert a.process.proc.returncode == 0, a.process.log()[-3000:]
    assert replies.by_task() == Counter({split: 1})
    assert queue_counts(queue) == (len(held), 0)
