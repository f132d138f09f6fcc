"""Start and stop real shoal processes (worker, gateway, Flower) for tests.

Every test session gets its own queue prefix, so it never touches the queues
of a stack a developer is running, and deletes its queues at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kombu import Connection

REPO = Path(__file__).resolve().parent.parent
BROKER_URL = os.environ.get("SHOAL_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05):
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


class Process:
    """A child process whose output goes to a log file the test can read."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

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
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


class Stack:
    """Settings shared by the processes of one test session."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.processes: list[Process] = []

    def _start(self, name: str, argv: list[str], **overrides: str) -> Process:
        env = {**self.env, **overrides}
        process = Process(name, argv, env, self.log_dir)
        self.processes.append(process)
        return process

    def worker(self, name: str, models: list[str], **overrides: str) -> Process:
        argv = [
            sys.executable, "-m", "celery", "-A", "app", "worker", "--pool", "threads",
            "--concurrency", "1", "--events", "--without-gossip", "--without-mingle",
            "--loglevel", "info", "--hostname", f"{name}@%h",
        ]
        return self._start(name, argv, SHOAL_MODELS=",".join(models), **overrides)

    def gateway(self, name: str, port: int, models: list[str], **overrides: str) -> Process:
        argv = [sys.executable, "-m", "app.cli", "gateway", "--port", str(port),
                "--log-level", "warning"]
        return self._start(name, argv, SHOAL_MODELS=",".join(models), **overrides)

    def flower(self, name: str, port: int) -> Process:
        argv = [sys.executable, "-m", "celery", "-A", "app", "flower", f"--port={port}",
                "--address=127.0.0.1", "--broker_api=http://guest:guest@127.0.0.1:15672/api/"]
        return self._start(name, argv, FLOWER_UNAUTHENTICATED_API="true")

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def print_logs(self, tail: int = 5000) -> None:
        """The end of every process's log, for a test that failed while setting up."""
        for process in self.processes:
            print(f"--- {process.name} log ---\n{process.log()[-tail:]}")


def queue_counts(name: str) -> tuple[int, int]:
    """(ready messages, consumers) of a queue, read with a passive declare."""
    with Connection(BROKER_URL) as conn:
        _, messages, consumers = conn.default_channel.queue_declare(queue=name, passive=True)
        return messages, consumers


def delete_queues(names: list[str]) -> None:
    for name in names:
        # A queue this session never declared is fine to miss.
        with Connection(BROKER_URL) as conn, contextlib.suppress(Exception):
            conn.default_channel.queue_delete(name)
