"""A real worker's probes (app.worker.health) through its life: starting, ready, its broker
lost and back, draining after SIGTERM.

The worker reaches RabbitMQ through a TCP relay of the test's own, so the test decides
when the broker is reachable: the worker starts with it closed (it loads its model, then
retries the broker: not ready, yet alive), consumes once it opens, loses the broker when
the relay drops its connections, and comes back when it reopens. Requests go to the model
queue as a Celery client sends them (tests/e2e/test_worker_shutdown.Replies); the
`test/faulty` model's @@slow@@ marker keeps a batch running while the worker drains.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

from tests.conftest import FAULTY
from tests.e2e.test_worker_shutdown import SLOW, Replies
from tests.slow_batches import SlowBatches
from tests.stack import BROKER_URL, MeteredWorker, free_port, private_stack, wait_for

pytestmark = pytest.mark.e2e

STALL_S = 3.0  # SHOAL_WORKER_STALL_S: the loop's timer ticks every 0.75 s


class Relay:
    """A TCP relay on a port of its own to the test broker, opened and closed at will;
    closing it drops every connection it carries and refuses new ones."""

    def __init__(self) -> None:
        broker = urlsplit(BROKER_URL)
        self.target = (broker.hostname or "127.0.0.1", broker.port or 5672)
        self.port = free_port()
        self.url = BROKER_URL.replace(broker.netloc.rsplit("@", 1)[-1], f"127.0.0.1:{self.port}")
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def open(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)


def probe(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def test_the_probes_follow_the_worker_from_start_to_drain(tmp_path):
    # The worker stops (private_stack's exit) before the relay closes.
    with contextlib.closing(Relay()) as relay, contextlib.closing(Replies()) as replies, \
            private_stack(tmp_path, "health", FAULTY) as private:
        port = free_port()
        slow_batches = SlowBatches(tmp_path / "slow", slow_s=0)
        process = private.stack.worker(
            "health", [FAULTY], SHOAL_QUEUE_PREFIX=private.prefix, SHOAL_BROKER_URL=relay.url,
            SHOAL_WORKER_METRICS_PORT=str(port), SHOAL_SHUTDOWN_GRACE_S="25",
            SHOAL_WORKER_STALL_S=str(STALL_S), **slow_batches.env)
        worker = MeteredWorker(process, port)
        base = f"http://127.0.0.1:{port}"
        readyz, healthz = f"{base}/readyz", f"{base}/healthz"
        exited = lambda: None if process.alive() else "the worker exited"  # noqa: E731
        not_ready = {"status": "not-ready"}

        # Starting: served from the first moment, alive, not ready; the broker is closed.
        assert wait_for(lambda: probe(healthz), 120, "/healthz to answer",
                        give_up=exited) == (200, {"status": "ok"})
        assert probe(readyz) == (503, {**not_ready, "reason": "starting"})
        # Its model loaded, it retries the broker: still alive, still starting.
        wait_for(lambda: "Cannot connect" in process.log(), 120,
                 "the worker to try the closed broker", give_up=exited)
        assert probe(healthz) == (200, {"status": "ok"})
        assert probe(readyz) == (503, {**not_ready, "reason": "starting"})
        assert worker.metric("shoal_broker_connected") == 0  # /metrics served alongside

        # The broker opens: ready once it consumes, and it answers.
        relay.open()
        wait_for(lambda: probe(readyz) == (200, {"status": "ready"}), 120,
                 "/readyz to say ready", give_up=exited)
        assert probe(healthz) == (200, {"status": "ok"})
        answered = replies.publish(private.queue, "hello")
        reply = wait_for(lambda: replies.of(answered), 60, "a reply", give_up=exited)
        assert reply["status"] == "SUCCESS", reply
        # Its event loop ticks: consuming longer than SHOAL_WORKER_STALL_S is no stall.
        time.sleep(2 * STALL_S)
        assert probe(healthz) == (200, {"status": "ok"})

        # The broker lost: not ready, but alive (it reconnects by itself); then ready again.
        relay.close()
        wait_for(lambda: probe(readyz) == (503, {**not_ready,
                                                 "reason": "broker-disconnected"}),
                 60, "/readyz to say broker-disconnected", give_up=exited)
        assert probe(healthz) == (200, {"status": "ok"})
        relay.open()
        wait_for(lambda: probe(readyz) == (200, {"status": "ready"}), 120,
                 "/readyz to say ready after the reconnect", give_up=exited)

        # SIGTERM while a batch runs (held in the model till the drain was seen): not
        # ready (draining) before the process exits.
        slow_batches.hold()
        slow = replies.publish(private.queue, f"{SLOW} the long batch")
        wait_for(lambda: worker.metric("shoal_batch_requests_count") >= 2, 60,
                 "the slow batch to start", give_up=exited)
        process.kill(signal.SIGTERM)
        wait_for(lambda: probe(readyz) == (503, {**not_ready, "reason": "draining"}), 30,
                 "/readyz to say draining", give_up=exited)
        assert probe(healthz) == (200, {"status": "ok"})  # draining is no stall
        assert process.alive() and replies.of(slow) is None  # the batch still runs
        slow_batches.release()
        reply = wait_for(lambda: replies.of(slow), 60, "the slow request's reply")
        assert reply["status"] == "SUCCESS", reply
        process.reap(30)
        assert process.proc.returncode == 0, process.log()[-3000:]
        assert "draining for shutdown" in process.log()
