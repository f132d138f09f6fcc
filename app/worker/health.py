"""A worker's own health for Kubernetes' probes: /readyz and /healthz, next to /metrics.

One small HTTP server (standard library, a daemon thread per request) on
SHOAL_WORKER_METRICS_HOST:SHOAL_WORKER_METRICS_PORT answers:

- `/readyz`: 200 `{"status": "ready"}` once the worker consumes its model queues (the
  consumer step has started: pinned models loaded, consumers registered) with its broker
  link up and no shutdown under way; else 503 `{"status": "not-ready", "reason": ...}`,
  the reason `starting`, `broker-disconnected` or `draining`.
- `/healthz` (liveness): 200 `{"status": "ok"}` unless the worker is wedged: it consumes
  with its broker link up, yet its event loop has not run the tick timer for more than
  SHOAL_WORKER_STALL_S: then 503 `{"status": "stalled", "seconds": age}`. Loading models
  and reconnecting to the broker are not stalls (restarting would only lose the models).
- `/metrics`: Prometheus, the default registry. Anything else: 404.

The health steps (`app.worker.steps.health`) report in on the event loop: `consuming(hub)`
when it has started, `stopped()` when it stops, `draining()` when a shutdown begins.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from tasks.broker_metrics import BrokerLink, worker_link

log = logging.getLogger(__name__)

# How often the event loop proves it turns (at most; a quarter of the stall bound if less).
TICK_S = 5.0


class WorkerHealth:
    """What the probes read (from the server's threads), written on the worker's loop."""

    def __init__(self, stall_s: float, link: BrokerLink | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self.link = link if link is not None else worker_link()
        self.clock = clock
        self.is_consuming = False
        self.has_consumed = False
        self.is_draining = False
        self.last_tick = clock()
        self._timer: Any = None
        self._metrics = make_wsgi_app()

    @property
    def tick_s(self) -> float:
        return min(TICK_S, self.stall_s / 4)

    # --- reported by the worker, on its event loop ----------------------------------------

    def consuming(self, hub: Any) -> None:
        """The step consumes its queues: ticks from `hub` start (again, after a reconnect)."""
        self.stopped()
        self.tick()
        self._timer = hub.call_repeatedly(self.tick_s, self.tick)
        self.is_consuming = self.has_consumed = True

    def stopped(self) -> None:
        self.is_consuming = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def draining(self) -> None:
        self.is_draining = True

    def tick(self) -> None:
        self.last_tick = self.clock()

    # --- read by the probes ---------------------------------------------------------------

    def readiness(self) -> tuple[int, dict[str, Any]]:
        if self.is_draining:
            reason = "draining"
        elif not self.has_consumed:
            reason = "starting"  # loading models, connecting: the broker link may be down
        elif not self.link.up:
            reason = "broker-disconnected"
        elif not self.is_consuming:
            reason = "starting"  # reconnected, the consumers not yet back
        else:
            return 200, {"status": "ready"}
        return 503, {"status": "not-ready", "reason": reason}

    def liveness(self) -> tuple[int, dict[str, Any]]:
        age = self.clock() - self.last_tick
        if self.is_consuming and self.link.up and age > self.stall_s:
            return 503, {"status": "stalled", "seconds": round(age, 1)}
        return 200, {"status": "ok"}

    # --- the WSGI application ---------------------------------------------------------------

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics(environ, start_response)
        if path == "/readyz":
            status, body = self.readiness()
        elif path == "/healthz":
            status, body = self.liveness()
        else:
            status, body = 404, {"status": "not-found"}
        data = json.dumps(body).encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                   ("Cache-Control", "no-store")]
        start_response(f"{status} {HTTPStatus(status).phrase}", headers)
        return [data]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # probes every few seconds would flood the worker's log


def serve(host: str, port: int, app: Callable[..., Iterable[bytes]]) -> WSGIServer | None:
    """Serve `app` on host:port from a daemon thread (port 0 disables); a taken port
    only costs a warning, as a worker without its probes still serves."""
    if port <= 0:
        return None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        server_class = type("HealthServer", (_ThreadingServer,), {"address_family": family})
        server = make_server(host, port, app, server_class=server_class,
                             handler_class=_QuietHandler)
    except OSError as exc:
        log.warning("worker health and metrics not served: %s port %d: %s", host, port, exc)
        return None
    threading.Thread(target=server.serve_forever, name="shoal-health", daemon=True).start()
    log.info("worker health and metrics on http://%s:%d (/healthz, /readyz, /metrics)",
             host, port)
    return server
