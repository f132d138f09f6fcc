"""Where the fault scripts run shoal: a fleet in network namespaces, or one machine.

With `netns`, `infra/netns-fleet.sh` provides the hosts: the gateway runs in
shoal-gw (10.77.0.10), each worker in its own namespace (shoal-w1, shoal-w2),
the broker and Redis on the bridge's address (10.77.0.1) in the root
namespace, where the load is driven from. Every process reaches the others by
address only: nothing shares a localhost, and each worker has a blob folder of
its own. Without `netns` (the 3-node broker cluster, whose nodes listen on
127.0.0.1) the same processes run on this machine's loopback.

The processes are `app.tuning.stack` processes (each in its own session, a log file
each); the stack uses a queue prefix of its own, deleted at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from app.tuning.stack import (
    Process,
    Stack,
    delete_queues,
    free_port,
    http_status,
    prefix_queues,
    queue_counts,
    wait_for,
)
from tasks.settings import REPO_ROOT, Settings
from tasks.topology import queue_for

FLEET_SCRIPT = REPO_ROOT / "infra" / "netns-fleet.sh"
FLEET_BROKER_URL = "amqp://shoal:shoal@10.77.0.1:5690//"
FLEET_REDIS_URL = "redis://10.77.0.1:6390/0"
HOST_IPS = {"gw": "10.77.0.10", "w1": "10.77.0.11", "w2": "10.77.0.12"}
GATEWAY_PORT = 8080
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def netns_unavailable() -> str | None:
    """Why the namespace fleet cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "redis-server"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists():
        return "RabbitMQ is not installed (/usr/lib/rabbitmq/bin/rabbitmq-server)"
    probe = f"shoal-probe-{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        return f"ip netns add is not permitted here: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def fleet(*args: str, timeout: float = 180) -> str:
    """Run infra/netns-fleet.sh; its output, or CalledProcessError with its stderr."""
    done = subprocess.run(["bash", str(FLEET_SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout,
                                            done.stderr)
    return done.stdout


def fleet_is_up() -> bool:
    return subprocess.run(["ip", "netns", "pids", "shoal-gw"], capture_output=True).returncode \
        == 0 and "broker:    amqp" in fleet("status")


@dataclass
class Fleet:
    stack: Stack
    url: str
    broker_urls: list[str]  # SHOAL_BROKER_URL's, in order
    prefix: str
    queue: str
    gateway: Process
    workers: dict[str, Process]  # host ("w1") -> its worker
    netns: bool
    cut_hosts: set[str] = field(default_factory=set)

    def worker_name(self, host: str) -> str:
        """Its Celery hostname's first part, as X-Worker shows it before the '@'."""
        return f"{self.prefix}-{host}"

    def host_of(self, worker: str) -> str | None:
        name = worker.partition("@")[0]
        return next((h for h in self.workers if self.worker_name(h) == name), None)

    def consumers(self) -> int | None:
        """Consumers of the model's queue (asked of the first broker node that answers);
        None when none does."""
        for url in self.broker_urls:
            with contextlib.suppress(Exception):
                return queue_counts(self.queue, url)[1]
        return None

    def cut(self, host: str) -> None:
        fleet("cut", host)
        self.cut_hosts.add(host)

    def heal(self, host: str) -> None:
        fleet("heal", host)
        self.cut_hosts.discard(host)

    def kill_worker(self, host: str) -> list[int]:
        """kill -9 the worker's own process (not its group, as a crash would); the pids of
        the children it leaves behind (its runtime process)."""
        pid = self.workers[host].pid
        children = _children(pid)
        os.kill(pid, signal.SIGKILL)
        return children

    def duplicate_replies(self) -> float | None:
        """The gateway's count of replies for requests already answered or given up."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("shoal_gateway_duplicate_replies_total "):
                return float(line.split()[1])
        return None


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _in(host: str | None) -> list[str]:
    return ["ip", "netns", "exec", f"shoal-{host}"] if host else []


@contextlib.contextmanager
def fleet_stack(log_dir: Path, *, netns: bool, broker_url: str | None = None,
                hosts: tuple[str, ...] = ("w1", "w2"), heartbeat_s: float = 5.0,
                log_level: str = "warning", keep_fleet: bool = False,
                extra_env: dict[str, str] | None = None) -> Iterator[Fleet]:
    """A gateway and a worker per host serving MiniLM, ready (each worker consumes).
    `netns`: in the namespace fleet (brought up if it is not, and taken down after
    unless `keep_fleet` or it was up before); else on loopback with `broker_url`."""
    brought_up = False
    if netns:
        brought_up = not fleet_is_up()
        fleet("up")
        broker_url = broker_url or FLEET_BROKER_URL
    if broker_url is None:
        raise ValueError("without netns, say which broker_url")
    prefix = f"shoal-faults-{os.getpid()}"
    gateway_ip = HOST_IPS["gw"] if netns else "127.0.0.1"
    port = GATEWAY_PORT if netns else free_port()
    env = {**os.environ, "SHOAL_BROKER_URL": broker_url, "SHOAL_QUEUE_PREFIX": prefix,
           "SHOAL_MODELS": MODEL, "SHOAL_GATEWAY_MODELS": MODEL,
           "SHOAL_BROKER_HEARTBEAT": f"{heartbeat_s:g}", "SHOAL_WORKER_METRICS_PORT": "0",
           "SHOAL_TORCH_THREADS": "1", "SHOAL_HOST": gateway_ip, "SHOAL_PORT": str(port),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if netns:
        env["SHOAL_REDIS_URL"] = FLEET_REDIS_URL
    urls = [u.strip() for u in broker_url.split(";") if u.strip()]
    stack = Stack(env, log_dir, cwd=REPO_ROOT)
    fleet_obj: Fleet | None = None
    try:
        gateway = stack.start("gateway", [
            *_in("gw" if netns else None), sys.executable, "-m", "app.cli", "gateway",
            "--host", gateway_ip, "--port", str(port), "--log-level", "warning"])
        workers = {}
        for host in hosts:
            workers[host] = stack.start(host, [
                *_in(host if netns else None), sys.executable, "-m", "app.cli", "worker",
                "--log-level", log_level, "--hostname", f"{prefix}-{host}@%h"],
                SHOAL_BLOB_URL=str(log_dir / f"blobs-{host}"))
        url = f"http://{gateway_ip}:{port}"
        queue = queue_for(MODEL, Settings(queue_prefix=prefix)).name
        fleet_obj = Fleet(stack, url, urls, prefix, queue, gateway, workers, netns)
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 120, "the gateway",
                 interval=0.2, give_up=stack.exited)
        # The gateway declares the queue on the first request; the workers on start.
        wait_for(lambda: (fleet_obj.consumers() or 0) >= len(hosts), 300,
                 f"{len(hosts)} workers to consume {queue}", interval=0.5,
                 give_up=stack.exited)
        yield fleet_obj
    except BaseException:
        stack.print_logs(tail=3000)
        raise
    finally:
        if fleet_obj is not None:
            for host in list(fleet_obj.cut_hosts):
                with contextlib.suppress(Exception):
                    fleet_obj.heal(host)
        stack.stop_all(timeout=20)
        for broker in urls:  # on a cluster, any node that is up deletes them (each
            with contextlib.suppress(Exception):  # failure is skipped)
                delete_queues(prefix_queues(prefix, [MODEL]), broker)
        if brought_up and not keep_fleet:
            fleet("down")


def wait_until(condition, timeout: float, interval: float = 0.25) -> float | None:
    """Poll until `condition()` is truthy: the monotonic time it was, or None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if condition():
                return time.monotonic()
        time.sleep(interval)
    return None
