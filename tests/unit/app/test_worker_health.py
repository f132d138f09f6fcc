"""The worker's probes (app.worker.health): readiness and liveness from the state the worker
reports, served with /metrics by a real HTTP server on a free port."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

import app.worker.metrics  # noqa: F401 (shoal's worker metrics, in the default registry)
from app.tuning.stack import free_port
from app.worker.health import WorkerHealth, serve
from tests.fakes import Hub

STALL_S = 30.0


@dataclass
class Link:
    up: bool = False


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def link() -> Link:
    return Link()


@pytest.fixture
def health(link: Link, clock: Clock) -> WorkerHealth:
    return WorkerHealth(STALL_S, link=link, clock=clock)  # type: ignore[arg-type]


def _consuming(health: WorkerHealth, link: Link) -> Hub:
    link.up = True
    hub = Hub()
    health.consuming(hub)
    return hub


def test_not_ready_while_starting_even_with_the_broker_up(health, link):
    assert health.readiness() == (503, {"status": "not-ready", "reason": "starting"})
    link.up = True  # connected, the consumer step not started (models loading)
    assert health.readiness() == (503, {"status": "not-ready", "reason": "starting"})


def test_ready_once_consuming_with_the_broker_up(health, link):
    _consuming(health, link)
    assert health.readiness() == (200, {"status": "ready"})


def test_a_lost_broker_is_broker_disconnected_then_starting_until_consuming_again(health, link):
    hub = _consuming(health, link)
    link.up = False
    assert health.readiness() == (503, {"status": "not-ready",
                                        "reason": "broker-disconnected"})
    health.stopped()  # Celery stops the step on the lost connection
    assert hub.repeating[0][2].cancelled
    assert health.readiness()[1]["reason"] == "broker-disconnected"
    link.up = True  # reconnected: the step not started again yet
    assert health.readiness() == (503, {"status": "not-ready", "reason": "starting"})
    health.consuming(hub)
    assert health.readiness() == (200, {"status": "ready"})


def test_draining_wins_over_everything_and_stays(health, link):
    _consuming(health, link)
    health.draining()
    assert health.readiness() == (503, {"status": "not-ready", "reason": "draining"})
    link.up = False
    health.stopped()
    assert health.readiness() == (503, {"status": "not-ready", "reason": "draining"})


def test_the_tick_timer_runs_on_the_hub_and_is_replaced_not_doubled(health, link):
    hub = _consuming(health, link)
    [(seconds, callback, first)] = hub.repeating
    assert 0 < seconds <= STALL_S / 4
    assert callback == health.tick
    health.consuming(hub)  # started again without a stop in between
    assert first.cancelled and not hub.repeating[1][2].cancelled
    assert WorkerHealth(0.4, link=link).tick_s == pytest.approx(0.1)  # type: ignore[arg-type]


def test_alive_while_the_loop_ticks(health, link, clock):
    _consuming(health, link)
    for _ in range(10):
        clock.now += STALL_S / 2
        health.tick()
        assert health.liveness() == (200, {"status": "ok"})


def test_stalled_when_consuming_with_the_broker_up_and_no_tick(health, link, clock):
    _consuming(health, link)
    clock.now += STALL_S  # not longer than the bound yet
    assert health.liveness() == (200, {"status": "ok"})
    clock.now += 12.34
    assert health.liveness() == (503, {"status": "stalled", "seconds": 42.3})
    health.tick()
    assert health.liveness() == (200, {"status": "ok"})


def test_no_stall_while_models_load_or_the_broker_is_away(health, link, clock):
    clock.now += 10 * STALL_S  # loading models: nothing ticks yet
    assert health.liveness() == (200, {"status": "ok"})
    _consuming(health, link)
    link.up = False  # broker gone: the loop reconnects, the timer may not run
    clock.now += 10 * STALL_S
    assert health.liveness() == (200, {"status": "ok"})
    health.stopped()
    link.up = True  # reconnected, the step not started again yet
    assert health.liveness() == (200, {"status": "ok"})
    health.consuming(Hub())  # consuming again counts from now, not from the last tick
    assert health.liveness() == (200, {"status": "ok"})


# --- over HTTP -------------------------------------------------------------------------------

def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read()


@pytest.fixture
def served(health):
    port = free_port()
    server = serve("127.0.0.1", port, health.app)
    assert server is not None
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def test_the_probes_answer_json_over_http(served, health, link, clock):
    assert _get(f"{served}/readyz") == (503, "application/json",
                                        b'{"status": "not-ready", "reason": "starting"}')
    assert _get(f"{served}/healthz") == (200, "application/json", b'{"status": "ok"}')
    _consuming(health, link)
    status, _, body = _get(f"{served}/readyz")
    assert (status, json.loads(body)) == (200, {"status": "ready"})
    clock.now += STALL_S + 1
    status, _, body = _get(f"{served}/healthz")
    assert (status, json.loads(body)) == (503, {"status": "stalled", "seconds": 31.0})


@pytest.mark.parametrize("path", ["/", "/metrics/x", "/ready", "/healthz/extra", "/favicon.ico"])
def test_other_paths_are_404(served, path):
    status, kind, body = _get(served + path)
    assert (status, kind) == (404, "application/json")
    assert json.loads(body) == {"status": "not-found"}


def test_metrics_are_still_served(served):
    status, kind, body = _get(f"{served}/metrics")
    assert status == 200 and kind.startswith("text/plain")
    text = body.decode()
    assert "\nshoal_worker_draining " in text
    assert "# TYPE shoal_batch_requests histogram" in text
    # prometheus_client's own query filter still works through the app
    status, _, body = _get(f"{served}/metrics?name[]=shoal_worker_draining")
    assert status == 200 and b"shoal_worker_draining" in body
    assert b"shoal_batch_requests" not in body


def test_concurrent_requests_are_each_served(served):
    # A client that opens a connection and sends nothing must not block the next probe.
    with socket.create_connection(("127.0.0.1", int(served.rsplit(":", 1)[1]))):
        assert _get(f"{served}/healthz")[0] == 200


def test_a_taken_port_costs_only_a_warning_and_port_0_serves_nothing(health, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="app.worker.health"):
            assert serve("127.0.0.1", port, health.app) is None
    assert f"port {port}" in caplog.text and "not served" in caplog.text
    assert serve("127.0.0.1", 0, health.app) is None
