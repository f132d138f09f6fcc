"""Operators see the worker, each request as a task, and the model queues in Flower, which
is behind basic auth (its credentials on no command line).

Task events (how Flower sees requests) follow Celery's convention: a worker sends
none unless started with -E (SHOAL_TASK_EVENTS) or until Flower, or `celery control
enable_events`, turns them on; `disable_events` turns them off again."""

from __future__ import annotations

import contextlib
import secrets
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from celery import Celery
from kombu import Connection, Exchange, Producer, Queue

from app.tuning import stack as app_stack
from tasks.envelope import CONTENT_ENCODING, CONTENT_TYPE, single_message, task_part
from tasks.settings import get_settings
from tests.conftest import MAIN_WORKER, MINILM, TINY_CLS, queue_name
from tests.stack import BROKER_URL, Process, free_port, wait_for

pytestmark = pytest.mark.e2e

Flower = tuple[str, httpx.Client, Process]


@pytest.fixture
def flowers(stack) -> Iterator[Callable[..., Flower]]:
    """Start Flowers of the test's own (name, env overrides) -> (url, a client with its
    credentials, the process); each is stopped after the test: a running Flower turns on
    the task events of every worker on its broker every 5 s."""
    started: list[Process] = []

    def start(name: str, **overrides: str) -> Flower:
        port = free_port()
        password = secrets.token_urlsafe(16)
        process = stack.stack.flower(name, port, password=password, **overrides)
        started.append(process)
        url = f"http://127.0.0.1:{port}"
        return url, httpx.Client(auth=("shoal", password), timeout=10), process

    yield start
    for process in started:
        process.stop()


def test_flower_asks_for_its_password_and_keeps_secrets_off_its_command_line(stack):
    port = free_port()
    password = secrets.token_urlsafe(16)
    management_url = "http://guest:guest@127.0.0.1:15672/api/"
    process = stack.stack.flower("flower-auth", port, management_url, password)
    url = f"http://127.0.0.1:{port}"
    try:
        status = wait_for(lambda: httpx.get(f"{url}/api/workers", timeout=5).status_code, 60,
                          "Flower to answer",
                          give_up=lambda: None if process.alive() else "exited")
        assert status == 401
        for path in ("/", "/broker", "/api/tasks"):
            assert httpx.get(f"{url}{path}", timeout=5).status_code == 401, path
            assert httpx.get(f"{url}{path}", auth=("shoal", "wrong"),
                             timeout=5).status_code == 401
            assert httpx.get(f"{url}{path}", auth=("shoal", password),
                             timeout=10).status_code == 200, path
        # `shoal flower` became Flower (exec): its command line is all `ps` shows.
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
        assert "flower" in cmdline
        assert password not in cmdline and "guest:guest" not in cmdline
    finally:
        process.stop()


def test_flower_lists_worker_tasks_and_queues(flowers):
    from tasks.client import encode

    url, http, _ = flowers("flower")

    def workers() -> dict:
        return http.get(f"{url}/api/workers", params={"refresh": "true"}).json()

    names = wait_for(lambda: [w for w in workers() if w.startswith(f"{MAIN_WORKER}@")], 60,
                     "Flower to list the worker")

    def task_seen() -> dict | None:
        # Flower sees only events sent after it connected, and the worker sends them once
        # Flower's enable_events reached it: send until one shows up.
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


def test_flower_shows_each_request_of_a_coalesced_message(flowers):
    """Requests that shared one broker message are one Flower task each."""
    from tests.e2e.test_coalescing import _collect, _delete, _entry, _publish, _reply_queue

    url, http, _ = flowers("flower-coalesced")
    wait_for(lambda: [w for w in http.get(f"{url}/api/workers", params={"refresh": "true"}
                                          ).json() if w.startswith(f"{MAIN_WORKER}@")],
             60, "Flower to list the worker")
    entry = _entry(MINILM)
    reply_to = _reply_queue()

    def shown() -> list[dict]:
        # Flower sees only events sent after it connected, and the worker sends them once
        # Flower's enable_events reached it: publish until they show up.
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


# --- task events: off unless -E, on once Flower (or enable_events) turns them on ----------

SIM = {"SHOAL_RUNTIME": "sim", "SHOAL_SIM_COST_A_MS": "0", "SHOAL_SIM_COST_B_US": "0",
       "SHOAL_SIM_COST_C_NS": "0"}


def _vhost_url(vhost: str) -> str:
    parts = urllib.parse.urlsplit(BROKER_URL)
    return urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(vhost, safe="")))


@contextlib.contextmanager
def _own_vhost() -> Iterator[str]:
    """A RabbitMQ virtual host of the test's own (its broker URL), deleted afterwards with
    everything on it. Remote control and events stay inside a virtual host, so no other
    Flower on this broker (another test session's, a `make run`) turns on the task events
    of a worker there, and no other worker's events reach the test."""
    name = f"shoal-test-events-{uuid.uuid4().hex[:8]}"
    api = get_settings().management_url.rstrip("/")
    user = urllib.parse.unquote(urllib.parse.urlsplit(BROKER_URL).username or "guest")
    vhost = urllib.parse.quote(name, safe="")
    with httpx.Client(timeout=10) as http:  # credentials from the management URL
        http.put(f"{api}/vhosts/{vhost}").raise_for_status()
        try:
            http.put(f"{api}/permissions/{vhost}/{urllib.parse.quote(user, safe='')}",
                     json={"configure": ".*", "write": ".*", "read": ".*"}).raise_for_status()
            yield _vhost_url(name)
        finally:
            http.delete(f"{api}/vhosts/{vhost}")


class EventTap:
    """Every event on a broker's event exchange, as a monitor such as Flower receives
    them: a queue of the test's own bound to `celeryev` for every routing key (Celery's
    worker sends task events in lists, routing key `task.multi`)."""

    def __init__(self, conn: Connection) -> None:
        from app.celery import app

        self.channel = conn.channel()
        self.queue = Queue(f"test-events-{uuid.uuid4().hex}",
                           Exchange(app.conf.event_exchange, type="topic"), routing_key="#",
                           exclusive=True, channel=self.channel)
        self.queue.declare()
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        while (message := self.channel.basic_get(self.queue.name, no_ack=True)) is not None:
            body = msgpack.unpackb(message.body, raw=False)
            self.events.extend(body if isinstance(body, list) else [body])
        return self.events

    def task_events(self, ids: set[str]) -> list[dict[str, Any]]:
        return [e for e in self.poll() if e["type"].startswith("task-") and e.get("uuid") in ids]

    def hostname(self, name: str) -> str:
        """The nodename of the worker whose hostname begins `name@` (from its events)."""
        return wait_for(lambda: next((e["hostname"] for e in self.poll()
                                      if e["hostname"].startswith(f"{name}@")), None),
                        30, f"an event of worker {name}")

    def wait_past(self, hostname: str, since: float) -> None:
        """Wait for the second heartbeat of `hostname` stamped after `since` (epoch s).
        The worker sends task events and heartbeats on one channel, so events arrive in
        the order sent; buffered task events are flushed on the event loop's next turn,
        and two heartbeats later that turn is past: every task event of what was answered
        before `since` has arrived by then, if one was sent."""
        def two() -> bool:
            return sum(e["type"] == "worker-heartbeat" and e["hostname"] == hostname
                       and e["timestamp"] > since for e in self.poll()) >= 2

        wait_for(two, 30, f"two heartbeats of {hostname}")


class PrivateWorker:
    """A worker (sim runtime) serving TINY_CLS in a virtual host of its own, with an event
    tap and a reply queue there."""

    def __init__(self, process: Process, broker_url: str, conn: Connection, tap: EventTap,
                 hostname: str) -> None:
        self.process = process
        self.broker_url = broker_url
        self.conn = conn
        self.tap = tap
        self.hostname = hostname
        self.reply_to = f"test-events-reply-{uuid.uuid4().hex}"
        self.channel = conn.channel()
        self.channel.queue_declare(queue=self.reply_to, exclusive=True)

    def answer(self, n: int, late: int = 0) -> dict[str, str]:
        """Send `n` requests, the last `late` of them past their deadline (a worker
        answers them DEADLINE_EXCEEDED: task-failed), each a plain Celery task message;
        once each is answered, their statuses by task id."""
        from tests.e2e.test_coalescing import _entry

        entry = _entry(TINY_CLS)
        producer = Producer(self.channel)
        ids = []
        for i in range(n):
            part = task_part(entry, {"model": TINY_CLS, "items": [{"text": f"events {i}"}]},
                             30_000)
            if i >= n - late:
                part = replace(part, annotations=replace(
                    part.annotations, deadline_ms=int(time.time() * 1000) - 1000))
            message = single_message(part, "test", reply_batch=False)
            producer.publish(message.body, routing_key=queue_name(TINY_CLS), exchange="",
                             headers=message.headers, content_type=CONTENT_TYPE,
                             content_encoding=CONTENT_ENCODING,
                             correlation_id=message.task_id, reply_to=self.reply_to,
                             delivery_mode=2)
            ids.append(message.task_id)
        statuses: dict[str, str] = {}

        def drain() -> bool:
            while (reply := self.channel.basic_get(self.reply_to, no_ack=True)) is not None:
                result = msgpack.unpackb(reply.body, raw=False)
                statuses[result["task_id"]] = result["status"]
            return set(ids) <= set(statuses)

        wait_for(drain, 60, f"answers to {n} requests",
                 give_up=lambda: None if self.process.alive() else "the worker exited")
        assert list(statuses.values()).count("FAILURE") == late, statuses
        return {task_id: statuses[task_id] for task_id in ids}

    def answered_without_task_events(self, n: int) -> dict[str, str]:
        """Requests answered, and then proof that no task event of theirs was sent."""
        statuses = self.answer(n, late=1)
        self.tap.wait_past(self.hostname, time.time())
        assert self.tap.task_events(set(statuses)) == []
        return statuses


@contextlib.contextmanager
def _private_worker(stack, **overrides: str) -> Iterator[PrivateWorker]:
    name = f"events-{uuid.uuid4().hex[:6]}"
    with _own_vhost() as broker_url, Connection(broker_url) as conn:
        tap = EventTap(conn)  # before the worker starts: it sees its worker-online
        process = stack.stack.worker(name, [TINY_CLS], SHOAL_BROKER_URL=broker_url,
                                     **SIM, **overrides)
        try:
            wait_for(lambda: app_stack.queue_counts(queue_name(TINY_CLS), broker_url)[1], 120,
                     "the private worker to consume",
                     give_up=lambda: None if process.alive() else "it exited")
            yield PrivateWorker(process, broker_url, conn, tap, tap.hostname(name))
        except BaseException:
            print(process.log()[-5000:])
            raise
        finally:
            process.stop()


def _control(broker_url: str, command: str, hostname: str) -> str:
    """A remote-control command to one worker, as `celery control <command>` sends it;
    the worker's answer."""
    control_app = Celery("test-control", broker=broker_url)
    control_app.conf.accept_content = ["msgpack", "json"]  # shoal's worker answers msgpack
    try:
        replies = control_app.control.broadcast(command, destination=[hostname], reply=True,
                                                timeout=10)
    finally:
        control_app.close()
    assert len(replies) == 1, replies
    return replies[0][hostname]["ok"]


def test_a_worker_sends_no_task_events_unless_enable_events_turned_them_on(stack):
    with _private_worker(stack) as worker:
        assert "task events: OFF" in worker.process.log()  # Celery's banner: no -E
        # (1) Started without -E: requests answered, no task event of theirs sent (the
        # tap does see the worker's heartbeats: worker events stay as Celery sends them).
        worker.answered_without_task_events(4)

        # `celery control enable_events` (what Flower sends) turns them on at run time:
        # every request sent after the worker's answer has its events.
        assert _control(worker.broker_url, "enable_events", worker.hostname) == \
            "task events enabled"
        statuses = worker.answer(4, late=1)

        def kinds() -> dict[str, set[str]]:
            seen: dict[str, set[str]] = {t: set() for t in statuses}
            for event in worker.tap.task_events(set(statuses)):
                seen[event["uuid"]].add(event["type"])
            done = all(("task-succeeded" if s == "SUCCESS" else "task-failed") in seen[t]
                       for t, s in statuses.items())
            return seen if done else {}

        seen = wait_for(kinds, 30, "the task events of every request")
        for task_id, status in statuses.items():
            if status == "SUCCESS":
                assert seen[task_id] == {"task-received", "task-started", "task-succeeded"}
            else:
                assert "task-failed" in seen[task_id]
        assert all(e["hostname"] == worker.hostname
                   for e in worker.tap.task_events(set(statuses)))

        # `disable_events` turns them off again.
        assert _control(worker.broker_url, "disable_events", worker.hostname) == \
            "task events disabled"
        worker.answered_without_task_events(4)


def test_a_worker_started_with_task_events_sends_them_from_the_start(stack):
    with _private_worker(stack, SHOAL_TASK_EVENTS="true") as worker:
        assert "task events: ON" in worker.process.log()
        statuses = worker.answer(3)
        wait_for(lambda: {e["uuid"] for e in worker.tap.task_events(set(statuses))
                          if e["type"] == "task-succeeded"} == set(statuses), 30,
                 "task-succeeded of every request")


def test_flower_turns_task_events_on_and_lists_each_request_sent_after(stack, flowers):
    with _private_worker(stack) as worker:
        worker.answered_without_task_events(2)
        url, http, flower = flowers("flower-events", SHOAL_BROKER_URL=worker.broker_url)
        # Flower sends enable_events to every worker 5 s after it starts, then every 5 s;
        # the worker logs it. Requests it reads after that carry their events.
        wait_for(lambda: "Events of group {task} enabled by remote" in worker.process.log(),
                 60, "Flower's enable_events to reach the worker")
        statuses = worker.answer(5, late=1)

        def listed() -> dict[str, dict]:
            tasks = http.get(f"{url}/api/tasks").json()
            infos = {t: tasks.get(t) or {} for t in statuses}
            return infos if all(infos[t].get("state") == s
                                for t, s in statuses.items()) else {}

        infos = wait_for(listed, 30, "Flower to list every request")
        for task_id, info in infos.items():
            assert info["worker"] == worker.hostname
            if statuses[task_id] == "SUCCESS":
                assert info["name"] == "shoal.encode"
                assert info["received"] and info["started"] and info["succeeded"]
        flower.stop()  # before its virtual host goes
