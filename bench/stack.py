"""Start a private shoal stack (worker + gateway) for one benchmark run.

It uses its own queue prefix and port, so a stack started with `make run`
is neither measured nor disturbed, and it stops everything on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchStack:
    url: str
    prefix: str  # the queue prefix of this stack
    pids: list[int]  # gateway, workers, their child processes, RabbitMQ
    log_dir: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


@contextlib.contextmanager
def bench_stack(model: str, extra_env: dict[str, str] | None = None,
                probe: tuple[str, bytes] | None = None, workers: int = 1,
                worker_argv: list[str] | None = None,
                prefix: str | None = None) -> Iterator[BenchStack]:
    """Gateway + `workers` workers serving `model` (or SHOAL_MODELS in `extra_env`); ready
    once the `probe` request (path, JSON body; default: encode one text) answers 200.

    `worker_argv` replaces shoal's worker command (a baseline deployment consuming the
    same queue); `prefix` is the queue prefix (default: one per benchmark process)."""
    port = _free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    prefix = prefix or f"shoal-bench-{os.getpid()}"
    env = {**os.environ, "SHOAL_QUEUE_PREFIX": prefix,
           "SHOAL_MODELS": model, "SHOAL_WORKER_METRICS_PORT": "0", **(extra_env or {})}
    argvs = {
        f"worker{i}": [*(worker_argv or [sys.executable, "-m", "app.cli", "worker",
                                          "--log-level", "warning"]),
                       # Unique per stack: Celery's pidbox queue is named after it.
                       "--hostname", f"{prefix}-w{i}@%h"]
        for i in range(workers)
    }
    argvs["gateway"] = [sys.executable, "-m", "app.cli", "gateway", "--port", str(port),
                        "--log-level", "warning"]
    procs = {}
    try:
        for name, argv in argvs.items():
            log = (log_dir / f"{name}.log").open("wb")
            procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        def ready(condition):  # fail fast when a process died instead of waiting it out
            def check() -> bool:
                dead = [n for n, p in procs.items() if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"{dead} exited while starting; see {log_dir}")
                return condition()
            return check

        _wait(ready(lambda: _ready(url)), 120, "the gateway")
        # The worker is ready once a request goes through.
        def served() -> bool:
            path, body = probe or (f"/v1/encode/{model}", b'{"items": [{"text": "warm up"}]}')
            request = urllib.request.Request(f"{url}{path}", data=body,
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status == 200
            except OSError:
                return False

        _wait(ready(served), 300, "the worker")
        if workers > 1:  # one answered; wait for the others to consume too
            first = env["SHOAL_MODELS"].split(",")[0].strip()
            _wait(ready(lambda: _consumers(prefix, first, env.get("SHOAL_BROKER_URL")) >= workers),
                  300, f"{workers} workers")
        worker_pids = [proc.pid for name, proc in procs.items() if name.startswith("worker")]
        # Runtime processes of shoal workers, pool processes of a baseline's.
        children = [pid for w in worker_pids for pid in _children(w)]
        # RabbitMQ's CPU belongs to the pipeline too (a local broker only).
        broker = [int(p) for p in subprocess.run(["pgrep", "-x", "beam.smp"], text=True,
                                                 capture_output=True).stdout.split()]
        pids = [procs["gateway"].pid, *worker_pids, *children, *broker]
        yield BenchStack(url, prefix, pids, log_dir)
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        _delete_queues(prefix, env["SHOAL_MODELS"].split(","), env.get("SHOAL_BROKER_URL"))


def _consumers(prefix: str, model: str, broker_url: str | None) -> int:
    from kombu import Connection

    from app.settings import get_settings
    from app.topology import model_slug

    with Connection(broker_url or get_settings().broker_url) as conn:
        name = f"{prefix}.model.{model_slug(model)}"
        return conn.default_channel.queue_declare(name, passive=True).consumer_count


def _delete_queues(prefix: str, models: list[str], broker_url: str | None) -> None:
    """Remove this run's model and dead-letter queues (durable: they would outlive us)."""
    from kombu import Connection

    from app.settings import get_settings
    from app.topology import model_slug

    with Connection(broker_url or get_settings().broker_url) as conn:
        names = [f"{prefix}.default"]  # Celery's own default queue
        for model in models:
            name = f"{prefix}.model.{model_slug(model.strip())}"
            names += [name, f"{name}.dead"]
        for queue in names:
            with contextlib.suppress(Exception):
                conn.default_channel.queue_delete(queue)
