"""The worker's dispatcher, driven without a broker or a model process: messages go in
through `on_message`, the loop is a fake hub the test runs, batches run on a tiny fake
runtime, and replies are read off a fake confirm-mode channel (confirmed when the test
says). The e2e tests (tests/e2e/test_coalescing.py, test_worker_shutdown.py, ...) run the
same paths against RabbitMQ and a real worker."""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import msgpack
import pytest
from celery.worker import state as worker_state

from app.worker.lifecycle.decisions import LoopSettings
from app.worker.lifecycle.dispatcher import Dispatcher
from app.worker.lifecycle.held import PARKED, RUNNING, SCHEDULED
from app.worker.lifecycle.loop import ConsumerLoop
from app.worker.lifecycle.view import WorkerView
from batching.feeder import Load
from batching.former import BatchLimits
from batching.hold import HoldLimits
from batching.lanes import Lane
from batching.latency_model import CostModel
from batching.pool import lora_key
from runtimes.base import BatchesOnly, Capabilities, Outcome, Request
from tasks.envelope import (
    H_MULTI,
    Annotations,
    Part,
    coalesce,
    decode_results,
    task_body,
    task_headers,
)
from tasks.errors import ErrorCode
from tasks.names import ENCODE
from tests.fakes import Hub, Message

MODEL = "m"
MB = 2**20


class Runtime(BatchesOnly):
    """A model runtime that answers each request with its item count, holds a batch until
    `go` is set, and fails the requests whose ids are in `fail`."""

    capabilities = Capabilities()
    device_bytes = None
    restarts = poison_isolated = spare_promotions = start_failures = 0
    pid = None

    def __init__(self) -> None:
        self.resident = {MODEL: MB}  # loaded from the start (pinned)
        self.batches: list[list[str]] = []
        self.started = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.fail: set[str] = set()
        self.restarting: set[str] = set()  # answered as a runtime whose restart is pending
        self.cancelled: list[str] = []  # the ids the worker told it to cancel

    def run_batch(self, model: str, requests: list[Request], on_deltas: Any = None,
                  ahead: Any = None) -> list[Outcome]:
        self.batches.append([r.id for r in requests])
        self.started.set()
        assert self.go.wait(10), "the test never let the batch end"
        return [Outcome(r.id, error_code=ErrorCode.POISON_INPUT, error_message="it broke")
                if r.id in self.fail else
                Outcome(r.id, error_code=ErrorCode.MODEL_UNAVAILABLE, error_message="restarting",
                        stats={"retry_after_s": 2.4})
                if r.id in self.restarting else
                Outcome(r.id, result={"count": len(r.kwargs["items"])})
                for r in requests]

    def estimate_bytes(self, model: str, lora: str | None = None) -> int:
        return MB

    def load(self, model: str, lora: str | None = None) -> int:
        return MB

    def unload(self, model: str, lora: str | None = None) -> None:
        pass

    def cancel(self, task_ids: list[str]) -> None:
        self.cancelled += task_ids

    def close(self) -> None:
        pass


class ContinuousRuntime(Runtime):
    """A runtime that batches continuously (as SGLang): one request at a time, each handed
    over with `submit` and ended when the test sets its future."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: dict[str, Future] = {}

    def continuous(self, model: str) -> bool:
        return True

    def load_of(self, model: str) -> Load:
        return Load(running=0, waiting=0, max_running=1)

    def submit(self, model: str, request: Request, on_deltas: Any) -> Future:
        future: Future = Future()
        self.submitted[request.id] = future
        return future

    def end(self, task_id: str) -> None:
        self.submitted[task_id].set_result(
            Outcome(task_id, result={"count": 1, "choices": []}))


class Channel:
    """The replier's confirm-mode channel: publishes are recorded, confirmed on `confirm`."""

    def __init__(self) -> None:
        self.events: dict[str, set] = {"basic_ack": set(), "basic_nack": set()}
        self.published: list[tuple[str, Any]] = []  # (routing key, amqp.Message)

    def confirm_select(self) -> None:
        pass

    def basic_publish(self, message: Any, exchange: str, routing_key: str) -> None:
        self.published.append((routing_key, message))

    def confirm(self) -> None:
        for on_ack in list(self.events["basic_ack"]):
            on_ack(len(self.published), True)


class Queue:
    def __init__(self, name: str) -> None:
        self.name = name
        self.consumer_arguments: dict[str, Any] = {}


class KombuConsumer:
    """A model queue's kombu consumer: what the dispatcher does to it, recorded."""

    def __init__(self) -> None:
        self.queues = [Queue("q.m")]
        self.consuming = False
        self.prefetch: int | None = None

    def qos(self, prefetch_count: int) -> None:
        self.prefetch = prefetch_count

    def consume(self) -> None:
        self.consuming = True

    def cancel(self) -> None:
        self.consuming = False


class Connection:
    def __init__(self) -> None:
        self.channel_opened = Channel()

    def channel(self) -> Channel:
        return self.channel_opened


class Worker:
    """The Celery consumer the dispatcher runs in: its hub, hostname and connection."""

    def __init__(self) -> None:
        self.hub = Hub()
        self.hostname = "w@test"
        self.connection = Connection()
        self.event_dispatcher = None  # task events off


class Fixture:
    def __init__(self, peers: int, max_items: int, cost: CostModel,
                 runtime: Runtime | None = None) -> None:
        self.runtime = runtime or Runtime()
        self.worker = Worker()
        self.hub = self.worker.hub
        lanes = {MODEL: Lane(MODEL, BatchLimits(max_tokens=10_000, max_items=max_items), cost)}
        self.dispatcher = Dispatcher(ConsumerLoop(self.worker), self.runtime, lanes,
                                     HoldLimits(horizon_batches=1.0, max_horizon_s=0.5),
                                     entries={}, pinned={MODEL},
                                     settings=LoopSettings(prefetch=8))
        self.view = WorkerView(self.dispatcher)  # as the worker's steps see it
        self.view.open(self.worker.connection)
        self.channel = self.worker.connection.channel_opened
        self.consumer = KombuConsumer()
        self.view.consume(MODEL, self.consumer, "q.m", lambda: peers, lambda: peers - 1)

    def deliver(self, message: Message) -> None:
        self.view.on_message(message)
        self.hub.run_timers()  # the tick it queued: a batch starts

    def finish_batch(self) -> None:
        """Let the running batch end and the loop take its answers."""
        self.runtime.go.set()
        self.hub.run_soon()
        self.hub.run_timers()

    def replies(self) -> dict[str, dict[str, Any]]:
        """Every result published so far, by task id."""
        out: dict[str, dict[str, Any]] = {}
        for routing_key, message in self.channel.published:
            if routing_key != "gw-1":
                continue
            multi = H_MULTI in (message.properties.get("application_headers") or {})
            for result in decode_results(message.body, multi):
                out[result["task_id"]] = result
        return out


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[Fixture] = []

    def build(peers: int = 1, max_items: int = 8, cost: CostModel | None = None,
              runtime: Runtime | None = None) -> Fixture:
        fixture = Fixture(peers, max_items, cost or CostModel(0.001, 0.0, 0.0), runtime)
        made.append(fixture)
        return fixture

    yield build
    for fixture in made:
        fixture.runtime.go.set()
        fixture.view.close()


def _annotations(items: int = 1) -> Annotations:
    return Annotations(MODEL, "encode", items, 10 * items, 10, None, None)


def _kwargs(items: int) -> dict[str, Any]:
    return {"model": MODEL, "items": [{"text": f"t{i}"} for i in range(items)]}


def single(task_id: str, items: int = 1) -> Message:
    """A request in a message of its own, as a gateway sends it."""
    headers = task_headers(task_id, ENCODE, _annotations(items), "gw")
    return Message(headers=headers, body=task_body(_kwargs(items)))


def coalesced(task_ids: list[str]) -> Message:
    """Several requests in one message, each its own member."""
    members = [Part(t, _annotations(), task_body(_kwargs(1))) for t in task_ids]
    message = coalesce(MODEL, "encode", members, "gw")
    return Message(headers=message.headers, body=message.body)


def test_a_message_is_held_then_taken_into_a_batch_with_its_peers(make):
    f = make()
    f.runtime.go.clear()  # the first batch runs until the test says
    f.deliver(single("a"))
    assert f.runtime.started.wait(5) and f.runtime.batches == [["a"]]
    # Delivered while "a" runs: held, then batched together once it ends.
    f.deliver(coalesced(["b", "c"]))
    f.deliver(single("d", items=2))
    assert f.dispatcher.holdings.counts() == {(MODEL, RUNNING): 1, (MODEL, SCHEDULED): 3}
    assert f.dispatcher.holdings.running_ids() == {"a"}
    f.finish_batch()
    f.runtime.started.clear()
    assert f.runtime.started.wait(5)
    f.hub.run_soon()
    assert f.runtime.batches == [["a"], ["b", "c", "d"]]


def test_each_request_of_a_batch_gets_its_reply_and_a_failed_one_its_error(make):
    f = make()
    f.runtime.go.clear()
    f.runtime.fail = {"c"}
    message = coalesced(["b", "c"])
    f.deliver(single("a", items=3))
    f.deliver(message)
    f.finish_batch()
    f.finish_batch()
    replies = f.replies()
    assert replies["a"]["status"] == "SUCCESS" and replies["a"]["result"]["count"] == 3
    assert replies["b"]["status"] == "SUCCESS" and replies["b"]["result"]["count"] == 1
    assert replies["c"]["status"] == "FAILURE"
    assert replies["c"]["result"]["exc_message"] == [ErrorCode.POISON_INPUT, "it broke"]
    assert "retry_after" not in replies["c"]["result"]
    # Acked once the broker confirmed every reply the message's requests got.
    assert message.acks == 0
    f.channel.confirm()
    assert message.acks == 1 and message.requeues == 0


def test_a_runtime_that_is_restarting_says_when_to_come_back(make):
    f = make()
    f.runtime.go.clear()
    f.runtime.restarting = {"a"}
    f.deliver(single("a"))
    f.finish_batch()
    failure = f.replies()["a"]["result"]
    assert failure["exc_message"] == [ErrorCode.MODEL_UNAVAILABLE, "restarting"]
    assert failure["retry_after"] == 3  # whole seconds, rounded up, as Retry-After
    # A batch none of which ran teaches the cost model nothing (it took no time at all).
    assert f.dispatcher.scheduler.lanes[MODEL].cost.samples == 0
    f.deliver(single("b"))
    f.finish_batch()
    assert f.replies()["b"]["status"] == "SUCCESS"
    assert f.dispatcher.scheduler.lanes[MODEL].cost.samples == 1


def test_overflow_goes_back_whole_or_its_unsettled_members_are_republished(make):
    # A peer consumes the queue too, and a batch is predicted to take 2 s: what would
    # start beyond the hold horizon (0.5 s) goes back for the peer.
    f = make(peers=2, max_items=1, cost=CostModel(2.0, 0.0, 0.0))
    f.runtime.go.clear()
    first = coalesced(["a", "b"])
    f.deliver(first)
    assert f.runtime.started.wait(5) and f.runtime.batches == [["a"]]
    # "b" shares its message with the running "a": the message cannot go back in part, so
    # "b" is republished to the model's queue, as a message of its own, one return more.
    assert first.requeues == 0 and first.acks == 0
    forwarded = [m for key, m in f.channel.published if key == "q.m"]
    assert len(forwarded) == 1
    rows = msgpack.unpackb(forwarded[0].body, raw=False)
    assert [row[0] for row in rows] == ["b"] and rows[0][7] == 1
    # Messages of their own go back whole (requeued: their delivery count is the broker's),
    # but what the current consumer delivered (returning it would reopen its credit).
    others = {t: single(t) for t in ("c", "d", "e")}
    for message in others.values():
        f.deliver(message)
    held = {h.task_id for _, _, h in f.dispatcher.holdings.states()}
    returned = {t for t, m in others.items() if m.requeues == 1}
    assert returned and returned.isdisjoint(held) and returned | held == {"a", "c", "d", "e"}
    assert all(m.acks == 0 and m.dead == 0 for m in others.values())
    assert [key for key, _ in f.channel.published] == ["q.m"]  # none republished
    f.finish_batch()
    f.channel.confirm()
    assert first.acks == 1  # "a" answered, "b" handed on: both settled


def test_a_drain_stops_taking_hands_back_what_waits_and_finishes_what_runs(make):
    f = make(max_items=1)
    f.runtime.go.clear()
    running, waiting = single("a"), single("b")
    f.deliver(running)
    assert f.runtime.started.wait(5)
    f.deliver(waiting)
    drained: list[bool] = []
    assert f.view.begin_drain(lambda: drained.append(True)) == {MODEL: 1}
    f.view.check_drain()
    assert not f.consumer.consuming  # stopped taking
    assert waiting.requeues == 1 and not drained
    late = single("c")
    f.dispatcher.on_message(late)  # delivered before the broker saw the cancel
    assert late.requeues == 1 and f.view.handed_back == 2
    f.finish_batch()
    assert f.replies()["a"]["status"] == "SUCCESS"
    assert not drained  # its reply is not confirmed yet, its message not acked
    f.channel.confirm()
    assert drained == [True] and running.acks == 1
    assert f.view.answered == 1 and f.runtime.batches == [["a"]]


def test_a_request_for_an_adapter_not_loaded_is_parked_then_handed_back_by_a_drain(make):
    f = make()
    f.dispatcher.placement.ensure = lambda model, lora=None, asked=False: None  # loads later
    headers = task_headers("a", ENCODE, Annotations(
        MODEL, "encode", 1, 10, 10, None, None, lora="style"), "gw")
    message = Message(headers=headers, body=task_body(_kwargs(1)))
    f.deliver(message)
    assert f.dispatcher.holdings.counts() == {(MODEL, PARKED): 1}
    assert f.dispatcher.holdings.in_use() == {MODEL: 1, lora_key(MODEL, "style"): 1}
    f.view.begin_drain(lambda: None)
    assert message.requeues == 1 and not f.dispatcher.holdings.counts()


def test_a_continuous_runtime_is_fed_as_it_has_room_and_a_drain_waits_for_what_it_runs(make):
    runtime = ContinuousRuntime()
    f = make(runtime=runtime)
    first, second, third = single("a"), single("b"), single("c")
    f.deliver(first)
    f.deliver(second)
    # Room for one: "a" is handed over, "b" waits in the feeder.
    assert list(runtime.submitted) == ["a"] and not runtime.batches
    assert f.dispatcher.holdings.counts() == {(MODEL, "generating"): 1, (MODEL, "waiting"): 1}
    runtime.end("a")
    f.hub.run_timers()  # its answer, then a tick hands over the next
    assert f.replies()["a"]["status"] == "SUCCESS" and list(runtime.submitted) == ["a", "b"]
    f.deliver(third)
    drained: list[bool] = []
    assert f.view.begin_drain(lambda: drained.append(True)) == {MODEL: 1}  # "c" waited
    f.view.check_drain()
    assert third.requeues == 1 and not drained
    runtime.end("b")
    f.hub.run_timers()
    assert f.replies()["b"]["status"] == "SUCCESS" and not drained  # not confirmed yet
    f.channel.confirm()
    assert drained == [True] and second.acks == 1 and f.view.answered == 1


def test_a_requests_scheduler_entry_carries_its_annotations_field_by_field(make):
    """`Entries.pending` builds `Pending` positionally (once per request): each field
    lands where its name says."""
    from app.worker.lifecycle.held import Held
    from app.worker.lifecycle.replies import Delivery
    from tasks.envelope import now_ms

    f = make()
    deadline_ms = now_ms() + 5_000
    a = Annotations(MODEL, "encode", 3, 42, 17, deadline_ms, deadline_ms - 8_000.0, "ad",
                    bulk=True)
    held = Held(Delivery(Message()), "t-1", a, b"", 0)
    p = f.dispatcher.entries.pending(held, 4)
    assert p.handle is held and p.key == "t-1"
    assert p.group == ("encode", False)  # LoRAs mix by default
    assert (p.items, p.cost, p.longest) == (3, 42, 17)
    assert p.deliveries == 4 and p.returnable and p.bulk
    assert p.deadline is not None and 4.0 < p.deadline - p.received <= 5.0
    assert p.budget_s == pytest.approx(8.0)


def test_a_revoke_answers_what_waits_at_once_and_cancels_what_runs(make):
    f = make(max_items=1)
    f.runtime.go.clear()
    f.deliver(single("run"))
    assert f.runtime.started.wait(5)
    f.deliver(single("wait"))
    try:
        assert f.view.cancel(["run", "wait", "unknown"]) == ["run"]
        assert f.runtime.cancelled == ["run"]
        assert f.replies()["wait"]["result"]["exc_message"][0] == ErrorCode.CANCELLED
        assert f.dispatcher.holdings.counts() == {(MODEL, RUNNING): 1}
    finally:
        for task_id in ("run", "wait", "unknown"):
            worker_state.revoked.discard(task_id)


def _rooms_entered(run: Any) -> Counter[str]:
    """How many times `run()` enters each module of the worker's lifecycle from another
    (a call whose caller is in a different file), by module name."""
    entered: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        if callee != caller and f"{os.sep}lifecycle{os.sep}" in callee:
            entered[os.path.basename(callee)] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entered


def test_a_messages_walk_enters_intake_once_and_each_request_its_entry_once(make):
    """The loop applies what `Intake` decides: nothing calls back into it (issue 55)."""
    f = make()
    for message, requests in ((single("a"), 1), (coalesced(["b", "c", "d"]), 3)):
        entered = _rooms_entered(lambda m=message: f.view.on_message(m))
        assert entered["intake.py"] == 1, entered
        assert entered["entries.py"] == requests, entered  # where each waits: decided once
        assert entered["held.py"] == requests, entered  # into its lane, by `Holdings`
    assert f.dispatcher.holdings.counts() == {(MODEL, SCHEDULED): 4}
