"""Start, watch and stop a private shoal stack: gateway, workers, Flower, on one queue prefix.

Benchmarks and the end-to-end tests both run the real processes. Each stack
uses its own queue prefix (in the env it is given), so a stack someone runs
with `make run` is neither measured nor touched, and `delete_queues` removes
the prefix's queues afterwards: they are durable and would outlive it.

Every process gets its own session (a process group), so stopping one also
stops what it started (a worker's runtime process), and its output goes to a
log file in the stack's folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
             give_up: Callable[[], str | None] | None = None) -> Any:
    """Poll `condition` until it returns something truthy, and return that.

    An exception from `condition` counts as not yet (a port that is not open
    yet refuses); after `timeout` seconds TimeoutError names the last one.
    `give_up` returns why waiting longer is pointless (a process exited), or None.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if give_up is not None and (why := give_up()):
            raise RuntimeError(f"gave up waiting for {what}: {why}")
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


def http_status(url: str, timeout: float = 2.0) -> int:
    """The status of a GET; OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def gateway_ready(url: str, timeout: float = 5.0) -> str | None:
    """None if GET /readyz answers 200, else why not."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


class Process:
    """A child process in its own session, its output in `log_dir/<name>.log`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        self.kill(signal.SIGTERM)
        self.reap(timeout)

    def reap(self, timeout: float) -> None:
        """Wait for the exit (SIGKILL after `timeout` seconds) and close the log."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(5)
        self._log.close()


class Stack:
    """The processes of one stack, sharing one environment (its queue prefix included)."""

    def __init__(self, env: dict[str, str], log_dir: Path, cwd: Path | None = None) -> None:
        self.env = env
        self.log_dir = log_dir
        self.cwd = cwd
        self.processes: list[Process] = []

    def start(self, name: str, argv: list[str], **overrides: str) -> Process:
        """Any command (a baseline's worker, say) with this stack's env plus `overrides`."""
        process = Process(name, argv, {**self.env, **overrides}, self.log_dir, self.cwd)
        self.processes.append(process)
        return process

    def worker(self, name: str, models: list[str], log_level: str = "info",
               **overrides: str) -> Process:
        """`shoal worker` serving `models`. `name` is its Celery hostname's first part: it
        names the worker's pidbox queue, so it must be unique on the broker."""
        argv = [sys.executable, "-m", "app.cli", "worker", "--log-level", log_level,
                "--hostname", f"{name}@%h"]
        return self.start(name, argv, SHOAL_MODELS=",".join(models), **overrides)

    def gateway(self, name: str, port: int, models: list[str] | None, workers: int | None = None,
                **overrides: str) -> Process:
        """`shoal gateway` on `port` accepting `models` (SHOAL_GATEWAY_MODELS: ids or globs;
        None: the stack's env decides, by default every catalog model); `workers` > 1 runs
        that many gateway processes under uvicorn's supervisor (the Process is the
        supervisor; they are its children)."""
        argv = [sys.executable, "-m", "app.cli", "gateway", "--port", str(port),
                "--log-level", "warning"]
        if workers is not None:
            argv += ["--workers", str(workers)]
        if models is not None:
            overrides = {"SHOAL_GATEWAY_MODELS": ",".join(models), **overrides}
        return self.start(name, argv, **overrides)

    def flower(self, name: str, port: int, management_url: str | None = None,
               password: str | None = None, **overrides: str) -> Process:
        """`shoal flower` on 127.0.0.1:`port` behind basic auth, user SHOAL_FLOWER_USER
        (default shoal) and `password` (default: a fresh one nobody is told; pass one to
        use Flower), reading queues from RabbitMQ's management API (default: the settings').
        Both reach Flower through its environment, never its command line. When it starts
        (and every 5 s), Flower turns on the task events of every worker on its broker."""
        import secrets

        overrides["SHOAL_FLOWER_PASSWORD"] = password or secrets.token_urlsafe(24)
        if management_url is not None:
            overrides["SHOAL_MANAGEMENT_URL"] = management_url
        argv = [sys.executable, "-m", "app.cli", "flower", "--port", str(port),
                "--address", "127.0.0.1"]
        return self.start(name, argv, **overrides)

    def exited(self) -> str | None:
        """Which processes have exited, with where their logs are; None while all run."""
        dead = [p.name for p in self.processes if not p.alive()]
        return f"{dead} exited; see their logs in {self.log_dir}" if dead else None

    def stop_all(self, timeout: float = 15) -> None:
        """SIGTERM to every process at once (they shut down in parallel), then reap each."""
        for process in reversed(self.processes):
            process.kill(signal.SIGTERM)
        for process in reversed(self.processes):
            process.reap(timeout)

    def print_logs(self, tail: int = 5000) -> None:
        """The end of every process's log, for a run that failed while setting up."""
        for process in self.processes:
            print(f"--- {process.name} log ---\n{process.log()[-tail:]}")


def queue_counts(name: str, broker_url: str) -> tuple[int, int]:
    """(ready messages, consumers) of a queue, read with a passive declare."""
    from kombu import Connection

    with Connection(broker_url) as conn:
        _, messages, consumers = conn.default_channel.queue_declare(queue=name, passive=True)
        return messages, consumers


def prefix_queues(prefix: str, models: Iterable[str]) -> list[str]:
    """Every durable queue a stack on `prefix` serving `models` declares."""
    from tasks.settings import Settings
    from tasks.topology import queue_for

    settings = Settings(queue_prefix=prefix)
    # Celery's own default queue, and the jobs' reply queue every gateway declares.
    names = [f"{prefix}.default", f"{prefix}.jobs.replies"]
    for model in models:
        queue = queue_for(model.strip(), settings)
        names += [queue.name, queue.dead_letter_queue]
    return names


def delete_queues(names: Iterable[str], broker_url: str) -> None:
    from kombu import Connection

    for name in names:
        # A queue this stack never declared is fine to miss; a fresh connection each,
        # since a failed delete closes the channel.
        with Connection(broker_url) as conn, contextlib.suppress(Exception):
            conn.default_channel.queue_delete(name)
