"""No path deserialises pickle: a pickled body, or a message typed as pickle, on every queue
and route shoal consumes is refused, and the code it carries never runs.

Each payload holds a `_Bomb`: unpickling it makes a marker directory (pickle.dumps only
records the call), and the `armed` fixture first proves that loading such a payload does
run it. So the marker's absence, checked once the system has answered the way it refuses
(an error reply, a 4xx, a message logged and dropped), means the bytes were never
unpickled; where a consumer refused, it then serves a good message, so nothing was
refused merely because the consumer had died.

Paths: the model queues and their dead-letter queues (the worker's own consumer), Celery's
task queue and remote control (pidbox), the workers' pool-state exchange, the gateway's
reply queue and the jobs' reply queue, a Celery client's result backend, every POST route,
a job's records in Redis, and the worker <-> runtime frames.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from kombu import Connection, Producer

from app.worker.lifecycle.replies import rpc_result
from tasks.envelope import H_COALESCED, Annotations, read_coalesced, task_body, task_headers
from tasks.errors import ErrorCode, ShoalError
from tasks.queues import kombu_queues
from tasks.settings import Settings
from tasks.topology import queue_for
from tests.conftest import MAIN_WORKER, NER, PREFIX, RERANKER, SENTIMENT, TINY_CLS, UNSERVED
from tests.conftest import queue_name as model_queue
from tests.stack import BROKER_URL, Process, metric_sum, queue_counts, wait_for

pytestmark = pytest.mark.e2e

PICKLE = "application/x-python-serialize"  # kombu's (and so Celery's) pickle content type
MSGPACK = "application/x-msgpack"  # what shoal's messages say they are
FAILURE, SUCCESS = "FAILURE", "SUCCESS"


class _Bomb:
    """Makes the directory `path` if it is ever unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return os.mkdir, (str(self.path),)


class Armed:
    """Pickles that would make `marker` if loaded anywhere (the processes under test run on
    this machine, as this user)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker
        self.bomb = _Bomb(marker)

    def pickled(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def untouched(self) -> None:
        assert not self.marker.exists(), "a pickle was loaded: the code it carried ran"


@pytest.fixture
def armed(tmp_path: Path) -> Armed:
    # Loading a payload here must make its marker: its absence later then means the bytes
    # were never unpickled, not that they could not have run.
    control = Armed(tmp_path / "control")
    pickle.loads(control.pickled({"items": [{"text": control.bomb}]}))
    assert control.marker.is_dir()
    return Armed(tmp_path / "marker")


class ReplyQueue:
    """A reply queue of the test's own on the test broker; its replies, decoded as msgpack
    (what shoal's workers and Celery's rpc backend send here)."""

    def __init__(self) -> None:
        self.name = f"test-never-pickle-{uuid.uuid4().hex}"
        self.conn = Connection(BROKER_URL)
        self.channel = self.conn.channel()
        self.channel.queue_declare(queue=self.name)
        self.received: dict[str, dict] = {}

    def publish(self, routing_key: str, body: bytes, headers: dict[str, Any],
                content_type: str, correlation_id: str | None = None) -> None:
        Producer(self.channel).publish(
            body, routing_key=routing_key, exchange="", headers=headers, reply_to=self.name,
            correlation_id=correlation_id, content_type=content_type,
            content_encoding="binary")

    def wait(self, task_id: str, timeout: float) -> dict:
        def answered() -> dict | None:
            while (message := self.channel.basic_get(self.name, no_ack=True)) is not None:
                reply = msgpack.unpackb(message.body)
                self.received[reply["task_id"]] = reply
            return self.received.get(task_id)

        return wait_for(answered, timeout, f"a reply to {task_id}")

    def close(self) -> None:
        self.channel.queue_delete(self.name)
        self.conn.close()


@pytest.fixture
def replies() -> Iterator[ReplyQueue]:
    queue = ReplyQueue()
    yield queue
    queue.close()


class LogTail:
    """What a process of the stack logged since this was made."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self.start = len(process.log())

    def text(self) -> str:
        return self.process.log()[self.start:]

    def wait(self, *fragments: str, timeout: float = 30) -> str:
        """The new log once it holds every fragment."""
        def logged() -> str | None:
            text = self.text()
            return text if all(f in text for f in fragments) else None

        return wait_for(logged, timeout, f"{self.process.name} to log {fragments}")

    def wait_count(self, fragment: str, count: int, timeout: float = 10) -> None:
        """Until the new log holds `fragment` `count` times (one per message dropped)."""
        wait_for(lambda: self.text().count(fragment) == count, timeout,
                 f"{self.process.name} to log {fragment!r} {count} times")


def _gateway(stack: Any) -> Process:
    return next(p for p in stack.stack.processes if p.name == "gateway")


def _error(reply: dict) -> tuple[str, str]:
    """(code, message) of a FAILURE reply carrying a ShoalError."""
    assert reply["status"] == FAILURE, reply
    code, message = reply["result"]["exc_message"]
    return code, message


def _celery_headers(task_id: str, task: str = "shoal.encode") -> dict[str, Any]:
    """Celery protocol 2 headers as a plain Celery client writes them (no shoal headers)."""
    return {"lang": "py", "task": task, "id": task_id, "root_id": task_id, "parent_id": None,
            "group": None, "argsrepr": "()", "kwargsrepr": "{}", "origin": "test",
            "retries": 0, "eta": None, "expires": None, "timelimit": [None, None],
            "shadow": None, "ignore_result": False}


def _shoal_headers(task_id: str) -> dict[str, Any]:
    """The headers a gateway writes: the worker holds the body undecoded until its batch."""
    return task_headers(task_id, "shoal.encode",
                        Annotations(TINY_CLS, "encode", 1, 8, 8, None, None, None), "test")


def _good_request(replies: ReplyQueue, queue: str) -> None:
    """A msgpack request the same consumer answers: it is still serving."""
    task_id = str(uuid.uuid4())
    replies.publish(queue, task_body({"model": TINY_CLS, "items": [{"text": "after"}]}),
                    _shoal_headers(task_id), MSGPACK, task_id)
    reply = replies.wait(task_id, 120)  # the first request here may load the model
    assert reply["status"] == SUCCESS, reply


# --- the worker's consumers -------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [PICKLE, MSGPACK], ids=["pickle-type", "msgpack-type"])
@pytest.mark.parametrize("headers", [_celery_headers, _shoal_headers],
                         ids=["celery-headers", "shoal-headers"])
def test_model_queue_refuses_a_pickled_task(stack: Any, armed: Armed, replies: ReplyQueue,
                                            content_type: str,
                                            headers: Callable[[str], dict]) -> None:
    """A Celery task pickled (whatever its type says) is answered INVALID_REQUEST: read as
    msgpack on arrival (no shoal headers) or when its batch runs (with them)."""
    task_id = str(uuid.uuid4())
    body = armed.pickled(((), {"model": TINY_CLS, "items": [{"text": armed.bomb}]},
                          {"callbacks": None, "errbacks": None, "chain": None, "chord": None}))
    replies.publish(model_queue(TINY_CLS), body, headers(task_id), content_type, task_id)
    code, message = _error(replies.wait(task_id, 120))
    assert code == ErrorCode.INVALID_REQUEST and "not msgpack" in message, message
    armed.untouched()
    assert stack.worker.alive()
    _good_request(replies, model_queue(TINY_CLS))
    armed.untouched()


def test_model_queue_dead_letters_a_pickled_coalesced_message(stack: Any, armed: Armed,
                                                              replies: ReplyQueue) -> None:
    """A coalesced message (several requests) whose body is a pickle cannot be read: it is
    dead-lettered, and its dead letter, naming nobody to answer, is dropped."""
    log = LogTail(stack.worker)
    headers = {**_shoal_headers(str(uuid.uuid4())), H_COALESCED: 2}
    replies.publish(model_queue(TINY_CLS), armed.pickled([[str(uuid.uuid4()), armed.bomb]]),
                    headers, PICKLE)
    log.wait("coalesced message dead-lettered: it could not be read",
             f"dead-lettered requests [] of {TINY_CLS}: rejected")
    wait_for(lambda: queue_counts(model_queue(TINY_CLS) + ".dead")[0] == 0, 10,
             "the dead letter to be consumed")
    armed.untouched()
    _good_request(replies, model_queue(TINY_CLS))


def test_dead_letter_queue_answers_from_headers_and_never_reads_the_body(
        stack: Any, armed: Armed, replies: ReplyQueue) -> None:
    """A worker answers a dead letter from its headers alone: a pickled body is not read."""
    task_id = str(uuid.uuid4())
    replies.publish(model_queue(TINY_CLS) + ".dead",
                    armed.pickled([(), {"model": TINY_CLS, "items": [armed.bomb]}, {}]),
                    _celery_headers(task_id), PICKLE, task_id)
    code, message = _error(replies.wait(task_id, 30))
    assert code == ErrorCode.INTERNAL and "dead-lettered" in message, message
    armed.untouched()


def test_celery_task_queue_refuses_pickle(stack: Any, armed: Armed,
                                          replies: ReplyQueue) -> None:
    """Celery's own consumer (the worker's default queue, plain Celery tasks) refuses
    content it does not accept: the message is discarded unrun, and a msgpack task on the
    same queue still runs."""
    queue = Settings().queue_prefix + ".default"
    log = LogTail(stack.worker)
    task_id = str(uuid.uuid4())
    replies.publish(queue, armed.pickled(((armed.bomb,), {}, {})),
                    _celery_headers(task_id, "celery.accumulate"), PICKLE, task_id)
    logged = log.wait("Received invalid task message", "ContentDisallowed")
    assert "pickle" in logged
    wait_for(lambda: queue_counts(queue)[0] == 0, 10, "the pickled task to be discarded")
    armed.untouched()
    good = str(uuid.uuid4())
    replies.publish(queue, msgpack.packb([[1, 2], {}, {}]),
                    _celery_headers(good, "celery.accumulate"), MSGPACK, good)
    reply = replies.wait(good, 30)
    assert reply["status"] == SUCCESS and reply["result"] == [1, 2], reply
    assert task_id not in replies.received  # the refused one was never run, nor answered


def _worker_hostname() -> str:
    # %h in the worker's --hostname (tests/stack) is this machine's name.
    return f"{MAIN_WORKER}@{socket.gethostname()}"


def test_remote_control_refuses_a_pickled_command(stack: Any, armed: Armed) -> None:
    """A pickled remote-control command (`celery control shoal_unload`, serializer pickle)
    is not decoded: the worker logs it and drops it, and answers the next command."""
    from kombu import pidbox

    from tasks.celery_app import app

    hostname = _worker_hostname()
    # The worker's own pidbox queue (where the broadcast fanout puts it): this session's
    # worker alone gets it, not those of other test sessions on the broker.
    mailbox = pidbox.Mailbox("celery", type="fanout")
    node_queue = mailbox.get_queue(hostname).name
    log = LogTail(stack.worker)
    command = {"method": "shoal_unload", "arguments": {"model": armed.bomb},
               "destination": [hostname], "pattern": None, "matcher": None}
    with Connection(BROKER_URL) as conn:
        Producer(conn.default_channel).publish(
            command, exchange="", routing_key=node_queue, serializer="pickle",
            headers={"clock": 1, "expires": time.time() + 30})
    logged = log.wait("Can't decode message body", "ContentDisallowed")
    assert "pickle" in logged
    armed.untouched()
    app.conf.broker_url = BROKER_URL
    inspect = app.control.inspect(destination=[hostname], timeout=10)
    (report,) = inspect._request("shoal_models").values()
    assert TINY_CLS in {m["id"] for m in report["models"]}, report
    armed.untouched()


def test_pool_state_exchange_drops_a_pickled_state(stack: Any, armed: Armed) -> None:
    """Workers and gateways read the pool-state fanout as msgpack only: a pickled state is
    dropped (counted by the gateway, logged by the worker) and the next one is kept."""
    from tasks.envelope import CONTENT_ENCODING, CONTENT_TYPE
    from tasks.pool_state import pool_exchange

    metrics = f"{stack.url}/metrics"
    dropped = metric_sum(metrics, 'shoal_gateway_pool_states_total{outcome="dropped"}')
    log = LogTail(stack.worker)
    state = {"worker": "pickled@nowhere", "at": time.time(), "interval_s": 5.0,
             "models": [{"id": TINY_CLS, "state": "resident", "bomb": armed.bomb}]}
    with Connection(BROKER_URL) as conn:
        producer = Producer(conn.default_channel)
        # Typed as pickle, then as shoal's own type: the type is not what keeps pickle out.
        for content_type, encoding in ((PICKLE, "binary"), (CONTENT_TYPE, CONTENT_ENCODING)):
            producer.publish(armed.pickled(state), exchange=pool_exchange(PREFIX),
                             routing_key="", content_type=content_type,
                             content_encoding=encoding)
    wait_for(lambda: metric_sum(metrics, 'shoal_gateway_pool_states_total{outcome="dropped"}')
             >= dropped + 2, 10, "the gateway to drop both states")
    log.wait("ignored a malformed pool-state message")
    armed.untouched()
    kept = metric_sum(metrics, 'shoal_gateway_pool_states_total{outcome="kept"}')
    wait_for(lambda: metric_sum(metrics, 'shoal_gateway_pool_states_total{outcome="kept"}')
             > kept, 30, "the gateway to keep the worker's next state")


# --- the gateway's consumers ------------------------------------------------------------------


@pytest.fixture
def unserved() -> Iterator[str]:
    """UNSERVED's queue (no worker consumes it), declared as a gateway declares it and
    empty: a test takes the next message there as its own. Emptied again after it."""
    name = model_queue(UNSERVED)
    with Connection(BROKER_URL) as conn:
        for queue in kombu_queues(queue_for(UNSERVED, Settings())):
            queue(conn.default_channel).declare()
        # Earlier tests of the session leave requests there to expire (test_errors).
        conn.default_channel.queue_purge(name)
    yield name
    with Connection(BROKER_URL) as conn:
        conn.default_channel.queue_purge(name)


def _take(queue: str, timeout: float) -> Any:
    """The next message of `queue` (taken off it)."""
    with Connection(BROKER_URL) as conn:
        channel = conn.default_channel
        return wait_for(lambda: channel.basic_get(queue, no_ack=True), timeout,
                        f"a message on {queue}")


def _task_ids(message: Any) -> list[str]:
    headers = message.headers or {}
    if H_COALESCED in headers:
        return [part.task_id for part in read_coalesced(headers, message.body)]
    return [headers.get("id") or message.properties["correlation_id"]]


def _pickled_replies(armed: Armed, reply_to: str, task_id: str) -> None:
    """Replies to `task_id` as pickle: typed as such, and typed as msgpack."""
    body = armed.pickled({"task_id": task_id, "status": SUCCESS, "result": armed.bomb})
    with Connection(BROKER_URL) as conn:
        producer = Producer(conn.default_channel)
        for content_type in (PICKLE, MSGPACK):
            producer.publish(body, exchange="", routing_key=reply_to, correlation_id=task_id,
                             content_type=content_type, content_encoding="binary")


def _failure_reply(reply_to: str, task_id: str, error: ShoalError) -> None:
    """The FAILURE a worker would send (msgpack)."""
    body = msgpack.packb(rpc_result(task_id, FAILURE, error.as_celery_failure()),
                         use_bin_type=True)
    with Connection(BROKER_URL) as conn:
        Producer(conn.default_channel).publish(
            body, exchange="", routing_key=reply_to, correlation_id=task_id,
            content_type=MSGPACK, content_encoding="binary")


def test_gateway_reply_queue_drops_pickled_replies(stack: Any, armed: Armed,
                                                   unserved: str) -> None:
    """Pickled replies to a waiting request are dropped by the gateway unread: the request
    is answered by the worker's next (msgpack) reply, as if they had never come."""
    log = LogTail(_gateway(stack))
    result: dict[str, httpx.Response] = {}

    def call() -> None:
        result["r"] = httpx.post(f"{stack.url}/v1/encode/{UNSERVED}",
                                 json={"items": [{"text": "x"}]},
                                 headers={"x-timeout-ms": "30000"}, timeout=40)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        message = _take(unserved, 20)
        (task_id,) = _task_ids(message)
        reply_to = message.properties["reply_to"]
        _pickled_replies(armed, reply_to, task_id)
        _failure_reply(reply_to, task_id,
                       ShoalError(ErrorCode.INVALID_REQUEST, "the reply after the pickles"))
    finally:
        caller.join(45)
    response = result["r"]
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == "the reply after the pickles"
    log.wait_count("undecodable reply dropped", 2)
    armed.untouched()


def test_jobs_reply_queue_drops_pickled_replies(stack: Any, armed: Armed,
                                                unserved: str) -> None:
    """The jobs' reply queue (every gateway consumes it) drops a pickled part result unread;
    the part's next (msgpack) result is the one the job records."""
    from gateway.jobs.part_replies import part_id, replies_queue

    r = httpx.post(f"{stack.url}/v1/jobs", json={"operation": "encode", "model": UNSERVED,
                                                 "items": [{"text": "x"}]}, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    _take(unserved, 20)  # the part, published: nobody will run it
    reply_to = replies_queue(PREFIX)
    log = LogTail(_gateway(stack))
    _pickled_replies(armed, reply_to, part_id(job_id, 0))
    _failure_reply(reply_to, part_id(job_id, 0),
                   ShoalError(ErrorCode.VALIDATION_ERROR, "the part result after the pickles"))

    def finished() -> dict | None:
        view = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=10).json()
        return view if view["state"] not in ("queued", "running") else None

    view = wait_for(finished, 30, "the job to finish")
    assert view["state"] == "failed", view
    assert "the part result after the pickles" in view["error"]["message"], view
    log.wait_count("undecodable job reply dropped", 2)
    assert queue_counts(reply_to)[0] == 0  # the pickles were acked, not left to come back
    armed.untouched()


def test_celery_client_refuses_a_pickled_result(stack: Any, armed: Armed,
                                                unserved: str) -> None:
    """A Celery client (tasks.client) accepts msgpack and JSON results only: a pickled one
    raises ContentDisallowed; the next, msgpack, result is read."""
    from kombu.exceptions import ContentDisallowed

    from tasks.client import app

    app.conf.broker_url = BROKER_URL
    pending = app.send_task("shoal.encode", kwargs={"model": UNSERVED,
                                                    "items": [{"text": "x"}]})
    message = _take(unserved, 20)
    assert _task_ids(message) == [pending.id]
    reply_to = message.properties["reply_to"]
    body = armed.pickled({"task_id": pending.id, "status": SUCCESS, "result": armed.bomb,
                          "traceback": None, "children": []})
    with Connection(BROKER_URL) as conn:
        Producer(conn.default_channel).publish(
            body, exchange="", routing_key=reply_to, correlation_id=pending.id,
            content_type=PICKLE, content_encoding="binary")
    with pytest.raises(ContentDisallowed, match="pickle"):
        pending.get(timeout=20)
    armed.untouched()
    _failure_reply(reply_to, pending.id,
                   ShoalError(ErrorCode.INVALID_REQUEST, "the result after the pickle"))
    with pytest.raises(ShoalError, match="the result after the pickle"):
        pending.get(timeout=20)
    armed.untouched()


# --- HTTP ------------------------------------------------------------------------------------


POST_ROUTES = [f"/v1/encode/{TINY_CLS}", "/v1/embeddings", f"/v1/score/{RERANKER}",
               f"/v1/extract/{NER}", f"/v1/classify/{SENTIMENT}", "/v1/completions",
               "/v1/chat/completions", "/v1/jobs"]
# What each Content-Type of a pickled body is answered: msgpack and JSON are parsed (and
# fail), anything else is not a type the gateway reads.
REFUSALS = {"application/x-python-pickle": (415, "UNSUPPORTED_MEDIA_TYPE"),
            PICKLE: (415, "UNSUPPORTED_MEDIA_TYPE"),
            "application/octet-stream": (415, "UNSUPPORTED_MEDIA_TYPE"),
            "application/x-msgpack": (400, "INVALID_REQUEST"),
            "application/msgpack": (400, "INVALID_REQUEST"),
            "application/json": (400, "INVALID_REQUEST")}


@pytest.mark.parametrize("content_type", list(REFUSALS))
def test_post_routes_refuse_a_pickled_body(stack: Any, armed: Armed, content_type: str) -> None:
    """Every POST route reads JSON or msgpack only: a pickle is a 4xx with a message (415
    for a type it does not read, 400 for one that does not parse), never a 500."""
    body = armed.pickled({"model": TINY_CLS, "input": "x", "items": [{"text": armed.bomb}],
                          "prompt": "x", "messages": [{"role": "user", "content": "x"}],
                          "operation": "encode"})
    status, code = REFUSALS[content_type]
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for route in POST_ROUTES:
            r = client.post(route, content=body, headers={"content-type": content_type})
            armed.untouched()
            assert r.status_code == status, (route, r.status_code, r.text)
            error = (msgpack.unpackb(r.content) if "msgpack" in r.headers["content-type"]
                     else r.json())["error"]
            assert error["code"] == code and error["message"], (route, error)
        # The same routes still serve.
        ok = client.post(f"/v1/encode/{TINY_CLS}", json={"items": [{"text": "after"}]},
                         timeout=120)
        assert ok.status_code == 200, ok.text


def test_job_upload_refuses_a_pickled_file(stack: Any, armed: Armed) -> None:
    """A bulk job's input is JSONL, read line by line as JSON: a pickle is refused (400,
    the line named) before anything is queued."""
    r = httpx.post(f"{stack.url}/v1/jobs",
                   params={"operation": "encode", "model": TINY_CLS},
                   content=armed.pickled([{"text": armed.bomb}]) + b"\n",
                   headers={"content-type": "application/x-ndjson"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "INVALID_REQUEST" and "line 1" in error["message"], error
    armed.untouched()


# --- a job's records in Redis -----------------------------------------------------------------


def test_job_driver_reads_its_redis_records_as_msgpack_only(stack: Any, armed: Armed,
                                                            unserved: str) -> None:
    """A part result recorded in Redis as a pickle fails its job when the driver gathers it
    (a clear error in the job's view), and is never unpickled."""
    import redis

    from gateway.jobs.store import JobStore

    r = httpx.post(f"{stack.url}/v1/jobs", json={"operation": "encode", "model": UNSERVED,
                                                 "items": [{"text": "x"}]}, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    _take(unserved, 20)  # the part, published: its result is planted below instead
    store = JobStore(Settings().redis_url, PREFIX, 60)
    client = redis.Redis.from_url(Settings().redis_url)
    try:
        # What recording a result does (gateway.jobs.store._RECORD), with a pickle.
        client.hset(store.parts_key(job_id), "0", armed.pickled({"result": armed.bomb}))
        client.hincrby(store.key(job_id), "parts_done", 1)

        def finished() -> dict | None:
            response = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=10)
            assert response.status_code == 200, response.text
            view = response.json()
            return view if view["state"] not in ("queued", "running") else None

        view = wait_for(finished, 30, "the driver to gather the job")
    finally:
        client.close()
    assert view["state"] == "failed", view
    # msgpack's word for a pickle: its first byte reads as an empty map, the rest is extra.
    assert view["error"]["code"] == "INTERNAL" and "extra data" in view["error"]["message"]
    armed.untouched()


# --- worker <-> runtime frames ----------------------------------------------------------------


def _decoders() -> dict[str, Any]:
    from runtimes.wire import frames, protocol

    return {"any": protocol._ANY,
            **{name: getattr(frames, name) for name in dir(frames)
               if name.endswith("_DECODER")}}


@pytest.mark.parametrize("decoder", sorted(_decoders()))
def test_runtime_frames_refuse_a_pickle(armed: Armed, decoder: str) -> None:
    """Both ends of the worker <-> runtime connection decode msgpack only: a frame whose
    body is a pickle is a ProtocolError (not msgpack, or not a frame: a pickle's first byte
    reads as an empty msgpack map), never loaded."""
    from runtimes.wire.protocol import ProtocolError, recv_frame

    body = armed.pickled({"frame": "run", "model": TINY_CLS, "requests": [armed.bomb]})
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(len(body).to_bytes(4, "big") + body)
        with pytest.raises(ProtocolError, match=r"not msgpack|unexpected frame"):
            recv_frame(ours, _decoders()[decoder])
    armed.untouched()
