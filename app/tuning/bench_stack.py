"""A private shoal stack (gateway + workers, `app.tuning.stack`) for one benchmark run.

It uses its own queue prefix and port, so a stack started with `make run`
is neither measured nor disturbed, and it stops everything on exit.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from app.tuning.stack import (
    Stack,
    delete_queues,
    free_port,
    http_status,
    prefix_queues,
    queue_counts,
    wait_for,
)


@dataclass(frozen=True)
class BenchStack:
    url: str
    prefix: str  # the queue prefix of this stack
    pids: list[int]  # gateway, workers, their child processes, RabbitMQ
    log_dir: Path
    # The processes that serve HTTP: the gateway itself, or with several gateway
    # processes the supervisor's workers (pids then also holds the supervisor).
    gateway_pids: tuple[int, ...] = ()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def gateway_workers_of(pid: int) -> list[int]:
    """The serving processes of `shoal gateway --workers N` (pid: its supervisor): the
    children uvicorn spawned, not multiprocessing's resource tracker."""
    workers = []
    for child in _children(pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                workers.append(child)
    return workers


def management_get(management_url: str, path: str, timeout: float = 10.0) -> Any:
    """GET `path` (e.g. "queues?columns=name") of RabbitMQ's management API at
    `management_url` (credentials in the URL, as SHOAL_MANAGEMENT_URL has them), as JSON."""
    parts = urlsplit(management_url)
    url = f"{parts.scheme}://{parts.hostname}:{parts.port or 15672}" \
          f"{parts.path.rstrip('/')}/{path}"
    request = urllib.request.Request(url)
    if parts.username:
        user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        request.add_header("Authorization", "Basic " + base64.b64encode(user.encode()).decode())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def reply_queues(prefix: str, management_url: str) -> dict[str, int]:
    """The gateways' reply queues on `prefix` ({prefix}.reply.<uuid>, one per gateway
    process) and their consumers, from RabbitMQ's management API (its queue list lags
    by up to its statistics interval), or, where the broker runs without that plugin,
    from `rabbitmqctl` on this host."""
    try:
        queues = management_get(management_url, "queues?columns=name,consumers")
    except OSError:  # no management plugin: a local broker answers rabbitmqctl
        listed = subprocess.run(["rabbitmqctl", "list_queues", "-q", "--no-table-headers",
                                 "name", "consumers"], capture_output=True, text=True,
                                timeout=60, check=True).stdout
        queues = [{"name": name, "consumers": int(count)} for name, count in
                  (line.rsplit("\t", 1) for line in listed.splitlines() if "\t" in line)]
    return {q["name"]: q.get("consumers") or 0 for q in queues
            if q["name"].startswith(f"{prefix}.reply.")}


def _answers(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> bool:
    request = urllib.request.Request(f"{url}{path}", data=body,
                                     headers={"content-type": "application/json",
                                              **(headers or {})})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status == 200


@contextlib.contextmanager
def bench_stack(model: str, extra_env: dict[str, str] | None = None,
                probe: tuple[str, bytes] | None = None, workers: int = 1,
                worker_argv: list[str] | None = None,
                prefix: str | None = None,
                gateway_workers: int | None = None,
                broker_pids: list[int] | None = None,
                probe_headers: dict[str, str] | None = None) -> Iterator[BenchStack]:
    """Gateway + `workers` workers serving `model` (or SHOAL_MODELS in `extra_env`); ready
    once the `probe` request (path, JSON body; default: encode one text) answers 200.

    `worker_argv` replaces shoal's worker command (a baseline deployment consuming the
    same queue); `prefix` is the queue prefix (default: one per benchmark process);
    `gateway_workers` the gateway's processes (default: SHOAL_GATEWAY_WORKERS, else 1),
    all connected (a reply queue each) before it is ready; `broker_pids` the broker's
    processes whose CPU is counted (default: every local `beam.smp`); `probe_headers` go
    with the probe (an API key's, when SHOAL_API_KEYS_FILE is in `extra_env`)."""
    from tasks.settings import Settings, get_settings
    from tasks.topology import queue_for

    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    prefix = prefix or f"shoal-bench-{os.getpid()}"
    env = {**os.environ, "SHOAL_QUEUE_PREFIX": prefix,
           "SHOAL_MODELS": model, "SHOAL_WORKER_METRICS_PORT": "0", **(extra_env or {})}
    models = [m.strip() for m in env["SHOAL_MODELS"].split(",")]
    broker_url = env.get("SHOAL_BROKER_URL") or get_settings().broker_url
    stack = Stack(env, log_dir)
    try:
        worker_names = [f"{prefix}-w{i}" for i in range(workers)]
        for name in worker_names:
            if worker_argv is None:
                stack.worker(name, models, log_level="warning")
            else:  # the hostname names Celery's pidbox queue: unique per stack
                stack.start(name, [*worker_argv, "--hostname", f"{name}@%h"])
        n_gateways = gateway_workers or int(env.get("SHOAL_GATEWAY_WORKERS") or 1)
        management_url = env.get("SHOAL_MANAGEMENT_URL") or get_settings().management_url
        # The management API lists a deleted queue for a while: count only new ones.
        earlier = set(reply_queues(prefix, management_url)) if n_gateways > 1 else set()
        gateway = stack.gateway("gateway", port, models, workers=gateway_workers)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 120, "the gateway",
                 interval=0.2, give_up=stack.exited)
        gateway_pids = [gateway.pid]
        if n_gateways > 1:  # /readyz answered from one; wait for all to hold a reply queue
            def connected() -> bool:
                queues = reply_queues(prefix, management_url)
                return sum(n > 0 for q, n in queues.items() if q not in earlier) >= n_gateways

            wait_for(connected, 120, f"{n_gateways} gateway processes", interval=0.2,
                     give_up=stack.exited)
            gateway_pids = wait_for(lambda: (pids := gateway_workers_of(gateway.pid))
                                    and len(pids) == n_gateways and pids, 10,
                                    "the gateway's processes")
        # The worker is ready once a request goes through.
        path, body = probe or (f"/v1/encode/{model}", b'{"items": [{"text": "warm up"}]}')
        wait_for(lambda: _answers(url, path, body, probe_headers), 300, "the worker",
                 interval=0.2,
                 give_up=stack.exited)
        if workers > 1:  # one answered; wait for the others to consume too
            queue = queue_for(models[0], Settings(queue_prefix=prefix)).name
            wait_for(lambda: queue_counts(queue, broker_url)[1] >= workers, 300,
                     f"{workers} workers", interval=0.2, give_up=stack.exited)
        worker_pids = [p.pid for p in stack.processes if p.name in worker_names]
        # Runtime processes of shoal workers, pool processes of a baseline's.
        children = [pid for w in worker_pids for pid in _children(w)]
        # RabbitMQ's CPU belongs to the pipeline too (a local broker only).
        broker = broker_pids if broker_pids is not None else [
            int(p) for p in subprocess.run(["pgrep", "-x", "beam.smp"], text=True,
                                           capture_output=True).stdout.split()]
        # The gateway's own children: its processes (and multiprocessing's resource tracker).
        children += _children(gateway.pid)
        yield BenchStack(url, prefix, [gateway.pid, *worker_pids, *children, *broker], log_dir,
                         tuple(gateway_pids))
    finally:
        stack.stop_all(timeout=30)
        delete_queues(prefix_queues(prefix, models), broker_url)
