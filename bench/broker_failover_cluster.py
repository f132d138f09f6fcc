"""The three-node RabbitMQ cluster bench.broker_failover (and its e2e test) runs on: free
ports for its nodes, started and stopped by infra/rabbitmq-cluster.sh, a node stopped and
started again."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import socket
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "infra" / "rabbitmq-cluster.sh"
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_bases(tries: int = 200) -> tuple[int, int, int]:
    """AMQP, distribution and management port bases whose ports +1..+3 are all free."""
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(20_000, 29_000, 10)
        bases = (base, base + 10_000, base + 20_000)
        if all(_free(b + n) for b in bases for n in (1, 2, 3)):
            return bases
    raise RuntimeError("no free ports for a private RabbitMQ cluster")


class Cluster:
    """A private 3-node cluster run by infra/rabbitmq-cluster.sh (its own folder, node
    names and ports, so it never meets another one, nor the system RabbitMQ)."""

    def __init__(self, directory: Path, name: str | None = None) -> None:
        amqp, dist, mgmt = _free_bases()
        self.name = name or f"shoalf{uuid.uuid4().hex[:6]}"
        self.env = {**os.environ, "SHOAL_CLUSTER_DIR": str(directory),
                    "SHOAL_CLUSTER_NAME": self.name, "SHOAL_CLUSTER_AMQP_BASE": str(amqp),
                    "SHOAL_CLUSTER_DIST_BASE": str(dist), "SHOAL_CLUSTER_MGMT_BASE": str(mgmt)}
        self.amqp_ports = [amqp + n for n in (1, 2, 3)]
        self.management_ports = [mgmt + n for n in (1, 2, 3)]

    @staticmethod
    def available() -> str | None:
        """Why a cluster cannot run here, or None."""
        if not RABBITMQ_SERVER.exists():
            return f"rabbitmq-server is not installed ({RABBITMQ_SERVER} missing)"
        return None

    def run(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([str(SCRIPT), *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmq-cluster.sh {' '.join(args)} failed "
                               f"({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def start(self) -> None:
        self.run("start")

    def stop(self) -> None:
        self.run("stop")

    def stop_node(self, n: int) -> None:
        self.run("stop-node", str(n))

    def start_node(self, n: int) -> None:
        self.run("start-node", str(n))

    @property
    def urls(self) -> list[str]:
        return [f"amqp://guest:guest@127.0.0.1:{p}//" for p in self.amqp_ports]

    @property
    def broker_url(self) -> str:
        return ";".join(self.urls)

    @property
    def management_url(self) -> str:
        return ";".join(f"http://guest:guest@127.0.0.1:{p}/api/"
                        for p in self.management_ports)

    def node_of(self, node_name: str) -> int:
        """1..3 for a node name (`shoalf1a2b3c2@localhost` -> 2)."""
        return int(node_name.split("@")[0].removeprefix(self.name))

    def management(self, path: str) -> Any:
        """GET a management API path from the first node that answers."""
        token = base64.b64encode(b"guest:guest").decode()
        last: Exception | None = None
        for port in self.management_ports:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/api/{path}",
                                             headers={"Authorization": f"Basic {token}"})
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    return json.load(response)
            except OSError as exc:
                last = exc
        raise RuntimeError(f"no node's management API answered: {last}")

    def leader(self, queue: str, vhost: str = "/") -> int:
        """The node (1..3) that leads a quorum queue now."""
        info = self.management(f"queues/{urllib.parse.quote(vhost, safe='')}/"
                               f"{urllib.parse.quote(queue, safe='')}")
        return self.node_of(info.get("leader") or info["node"])

    def queue_consumers(self, queue: str, vhost: str = "/") -> int:
        """Consumers of a queue, read with a passive declare on any node."""
        from kombu import Connection

        with Connection(self.broker_url, connect_timeout=3) as conn:
            return int(conn.default_channel.queue_declare(queue=queue, passive=True)
                       .consumer_count)


@contextlib.contextmanager
def running_cluster(directory: Path) -> Iterator[Cluster]:
    cluster = Cluster(directory)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
