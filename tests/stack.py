"""The test session's view of `app.tuning.stack`: the test broker, and processes run from this tree.

Every test session gets its own queue prefix (tests/conftest.py), so it never
touches the queues of a stack a developer is running, and deletes its queues
at the end.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.tuning import stack
from app.tuning.stack import Process, free_port, http_status, wait_for

__all__ = [
    "BROKER_URL",
    "REPO",
    "MeteredWorker",
    "PrivateStack",
    "Process",
    "Stack",
    "child_pid",
    "delete_queues",
    "free_port",
    "http_status",
    "metric_sum",
    "openai_client",
    "private_stack",
    "queue_counts",
    "start_metered_worker",
    "wait_for",
]

REPO = Path(__file__).resolve().parent.parent
BROKER_URL = os.environ.get("SHOAL_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


class Stack(stack.Stack):
    """A stack whose processes run in the repository, so `-m app...` imports this tree."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        super().__init__(env, log_dir, cwd=REPO)


def child_pid(parent: int, marker: bytes) -> int:
    """The child of `parent` whose command line contains `marker` (a worker's model runtime,
    an SGLang server), read from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and marker in cmdline:
            return int(entry.name)
    raise AssertionError(f"process {parent} has no child running {marker!r}")


class MeteredWorker:
    """A worker a test started, with its /metrics on a port of its own."""

    def __init__(self, process: Process, metrics_port: int) -> None:
        self.process = process
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def metric(self, name: str) -> float:
        return metric_sum(self.metrics_url, name)

    def child_pid(self, marker: bytes) -> int:
        return child_pid(self.process.pid, marker)


def openai_client(gateway_url: str) -> Any:
    """The official `openai` client on a gateway (no retries: a test sees every error)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def start_metered_worker(stack: stack.Stack, name: str, model: str, queue: str,
                         timeout: float, **overrides: str) -> MeteredWorker:
    """A worker of its own serving `model`, once it consumes the model's `queue`."""
    port = free_port()
    process = stack.worker(f"{name}-{uuid.uuid4().hex[:6]}", [model],
                           SHOAL_WORKER_METRICS_PORT=str(port), **overrides)
    wait_for(lambda: queue_counts(queue)[1] >= 1, timeout, f"the {name} worker to consume",
             give_up=lambda: not process.alive())
    return MeteredWorker(process, port)


def queue_counts(name: str) -> tuple[int, int]:
    """(ready messages, consumers) of a queue on the test broker."""
    return stack.queue_counts(name, BROKER_URL)


def delete_queues(names: Iterable[str]) -> None:
    stack.delete_queues(names, BROKER_URL)


def metric_sum(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) at a /metrics URL."""
    import httpx

    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class PrivateStack:
    """A stack of one test's own: its queue prefix (the session's queues stay untouched),
    the model queue under it, and a free port for its gateway."""

    prefix: str
    queue: str
    stack: Stack
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def private_stack(log_dir: Path, label: str, model: str) -> Iterator[PrivateStack]:
    """A stack of the test's own for `model`; on the way out its processes' logs are
    printed if the test failed, its processes stopped and its queues deleted."""
    from tasks.settings import Settings
    from tasks.topology import queue_for

    prefix = f"shoal-{label}-{uuid.uuid4().hex[:8]}"
    private = PrivateStack(prefix, queue_for(model, Settings(queue_prefix=prefix)).name,
                           Stack(dict(os.environ), log_dir), free_port())
    try:
        yield private
    except BaseException:
        private.stack.print_logs()
        raise
    finally:
        private.stack.stop_all()
        delete_queues(stack.prefix_queues(prefix, [model]))


def model_loads(metrics_port: int, model: str) -> float:
    """A worker's successful loads of `model` (shoal_model_loads_total{outcome="ok"})."""
    import httpx

    wanted = f'shoal_model_loads_total{{model="{model}",outcome="ok"}} '
    for line in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text.splitlines():
        if line.startswith(wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
