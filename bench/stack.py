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
    pids: list[int]  # gateway, worker, runtime process(es)
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


def _is_runtime(pid: int) -> bool:
    try:
        return b"runtimes.server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


@contextlib.contextmanager
def bench_stack(model: str, extra_env: dict[str, str] | None = None,
                probe: tuple[str, bytes] | None = None) -> Iterator[BenchStack]:
    """Gateway + worker serving `model` (or SHOAL_MODELS in `extra_env`); ready once the
    `probe` request (path, JSON body; default: encode one text) answers 200."""
    port = _free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    env = {**os.environ, "SHOAL_QUEUE_PREFIX": f"shoal-bench-{os.getpid()}",
           "SHOAL_MODELS": model, "SHOAL_WORKER_METRICS_PORT": "0", **(extra_env or {})}
    argvs = {
        "worker": [sys.executable, "-m", "app.cli", "worker", "--hostname", "bench@%h",
                   "--log-level", "warning"],
        "gateway": [sys.executable, "-m", "app.cli", "gateway", "--port", str(port),
                    "--log-level", "warning"],
    }
    procs = {}
    try:
        for name, argv in argvs.items():
            log = (log_dir / f"{name}.log").open("wb")
            procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _ready(url), 120, "the gateway")
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

        _wait(served, 300, "the worker")
        worker = procs["worker"].pid
        runtimes = [pid for pid in _children(worker) if _is_runtime(pid)]
        pids = [procs["gateway"].pid, worker, *runtimes]
        yield BenchStack(url, pids, log_dir)
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
