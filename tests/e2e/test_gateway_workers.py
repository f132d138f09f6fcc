"""`shoal gateway --workers 2`: two gateway processes on one port, in front of a sim worker.

Each process has its own Broker, so its own exclusive reply queue; /metrics,
whichever process answers it, sums both processes' counters (prometheus_client's
multiprocess files, one per pid, in the folder `shoal gateway` made); SIGTERM to
the command stops every process it started and removes that folder.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from app.tuning.bench_stack import gateway_workers_of, reply_queues
from tasks.settings import Settings
from tests.conftest import MINILM
from tests.stack import (
    Process,
    Stack,
    http_status,
    private_stack,
    queue_counts,
    wait_for,
)

pytestmark = pytest.mark.e2e

ZERO_COST_SIM = {"SHOAL_RUNTIME": "sim", "SHOAL_SIM_COST_A_MS": "0", "SHOAL_SIM_COST_B_US": "0",
                 "SHOAL_SIM_COST_C_NS": "0"}
ENCODE_ROUTE = "/v1/encode/{model}"
MANAGEMENT_URL = Settings().management_url


def _metrics_dir(pid: int) -> Path:
    """The PROMETHEUS_MULTIPROC_DIR a process was started with."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
            return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError(f"process {pid} has no PROMETHEUS_MULTIPROC_DIR")


def _encodes_served(families) -> float:
    """shoal_gateway_requests_total of the encode route with status 200."""
    return sum(sample.value for family in families for sample in family.samples
               if sample.name == "shoal_gateway_requests_total"
               and sample.labels == {"route": ENCODE_ROUTE, "status": "200"})


def _served_by(metrics_dir: Path, pid: int) -> float:
    """What one process counted: its own counter file (prometheus_client names it by pid)."""
    path = metrics_dir / f"counter_{pid}.db"
    return _encodes_served(MultiProcessCollector.merge([str(path)])) if path.exists() else 0.0


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def _descendants(pid: int) -> list[int]:
    try:
        children = [int(p) for p in
                    Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return children + [d for child in children for d in _descendants(child)]


def _gone_from_broker(queue: str) -> bool:
    try:
        queue_counts(queue)
    except Exception:  # the passive declare of a deleted queue fails with NOT_FOUND
        return True
    return False


async def _round(url: str, requests: int) -> None:
    """`requests` concurrent encodes, each on a new connection (so the kernel hands the
    connections to either process); every one must succeed."""
    async def one(i: int) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{url}/v1/encode/{MINILM}",
                                  json={"items": [{"text": f"text {i}"}]})
        assert r.status_code == 200, r.text
        assert len(r.json()["embeddings"][0]) == 384

    await asyncio.gather(*(one(i) for i in range(requests)))


def _start_gateway(stack: Stack, prefix: str, port: int) -> tuple[Process, list[str], list[int]]:
    """`shoal gateway --workers 2`, and its two processes once each holds a reply queue."""
    gateway = stack.gateway("gateway", port, [MINILM], workers=2, SHOAL_QUEUE_PREFIX=prefix)
    wait_for(lambda: http_status(f"http://127.0.0.1:{port}/readyz") == 200, 60,
             "the gateway to be ready", give_up=stack.exited)
    queues = wait_for(lambda: (q := {n for n, c in reply_queues(prefix, MANAGEMENT_URL).items()
                                     if c == 1}) and len(q) == 2 and q,
                      60, "two reply queues with a consumer each", give_up=stack.exited)
    processes = wait_for(lambda: (p := gateway_workers_of(gateway.pid)) and len(p) == 2 and p,
                         20, "the gateway's two processes")
    return gateway, sorted(queues), processes


def test_two_gateway_processes_serve_and_metrics_count_every_request(tmp_path):
    with private_stack(tmp_path, "gw2", MINILM) as private:
        prefix, queue, stack, port, url = (private.prefix, private.queue, private.stack,
                                           private.port, private.url)
        stack.worker(f"gw2-{prefix}", [MINILM], log_level="warning", SHOAL_QUEUE_PREFIX=prefix,
                     **ZERO_COST_SIM)
        # Two processes, two exclusive reply queues: a Broker (created in create_app) each.
        _, _, processes = _start_gateway(stack, prefix, port)
        wait_for(lambda: queue_counts(queue)[1] >= 1, 60, "the sim worker to consume",
                 give_up=stack.exited)
        metrics_dir = _metrics_dir(processes[0])
        assert _metrics_dir(processes[1]) == metrics_dir

        sent = 0

        def both_served() -> bool:
            nonlocal sent
            asyncio.run(_round(url, 64))
            sent += 64
            return all(_served_by(metrics_dir, pid) > 0 for pid in processes)

        # Which process accepts a connection is the kernel's choice: send rounds until
        # each has served some (almost always after the first).
        wait_for(both_served, 120, "both gateway processes to serve requests", interval=0,
                 give_up=stack.exited)

        per_process = {pid: _served_by(metrics_dir, pid) for pid in processes}
        assert sum(per_process.values()) == sent, per_process
        # /metrics, from whichever process answers, counts every request of both.
        for _ in range(4):
            r = httpx.get(f"{url}/metrics", timeout=10)
            assert r.status_code == 200
            assert _encodes_served(text_string_to_metric_families(r.text)) == sent


def test_sigterm_to_the_gateway_stops_all_its_processes(tmp_path):
    # Its own queues, deleted afterwards: the gateway declares the model queue.
    with private_stack(tmp_path, "gw2", MINILM) as private:
        prefix, stack = private.prefix, private.stack
        gateway, reply, processes = _start_gateway(stack, prefix, private.port)
        metrics_dir = _metrics_dir(processes[0])
        assert metrics_dir.is_dir()
        everything = _descendants(gateway.pid)  # its processes, the resource tracker
        assert set(processes) <= set(everything)

        os.kill(gateway.pid, signal.SIGTERM)  # the command alone, not its process group

        assert wait_for(lambda: gateway.proc.poll() is not None, 30, "the gateway to exit") \
            and gateway.proc.returncode == 0
        wait_for(lambda: all(_gone(pid) for pid in everything), 30,
                 "every gateway process to exit")
        assert not metrics_dir.exists()
        # Their connections closed, so their exclusive reply queues are gone.
        wait_for(lambda: all(_gone_from_broker(q) for q in reply), 30,
                 "the reply queues to be deleted")
