"""Faults under load: what a fleet loses, answers twice, and how fast it recovers.

    .venv/bin/python -m bench.faults --scenario worker-link-cut --runs 3
    .venv/bin/python -m bench.faults --scenario worker-kill --runs 3
    .venv/bin/python -m bench.faults --scenario broker-restart --runs 3
    .venv/bin/python -m bench.faults --scenario broker-node-stop --runs 3

The first three run on the network-namespace fleet (`infra/netns-fleet.sh`,
brought up and taken down here unless it is up already): the gateway in
shoal-gw, two MiniLM workers in shoal-w1 and shoal-w2, the broker (a private
RabbitMQ node) and Redis on the bridge in the root namespace, from where the
load is driven. `broker-node-stop` runs on this machine's loopback against the
3-node cluster of `infra/rabbitmq-cluster.sh`, with the nodes' URLs in
SHOAL_BROKER_URL (`;`-separated), and stops the node that leads the model's
queue.

Each run: steady load (`--rate` single-text /v1/embeddings requests a second,
each text unique) until both workers have answered, `--before` seconds of
steady state, the fault, `--fault` seconds in it (a cut link is healed after
them, and the cut worker must consume again), `--after` seconds more; then
every answer's embedding is checked against the model's embedding of its own
text (computed here), so a reply that reached the wrong caller would show.

Scenarios:
- worker-link-cut: w1's link goes down (the bridge's end of its veth: packets
  vanish, no socket sees an error). The broker requeues what w1 held once it
  misses w1's heartbeats (SHOAL_BROKER_HEARTBEAT, `--heartbeat`); w2 answers it.
- worker-kill: kill -9 of w1's worker process (not its runtime: that one must
  notice and exit); the broker requeues at once (the socket closes).
- broker-restart: the broker node is stopped and started again under load;
  gateway and workers reconnect. A request the gateway cannot publish is a
  retryable 503; one it had published must be answered.
- broker-node-stop: the leader of the model's quorum queue is stopped (and
  started again after `--fault`); gateway and workers fail over to the others.

Columns: sent; answered (200); retryable (503/429 with Retry-After); lost (no
answer, or an error that is not retryable: a 504 means the system dropped the
request silently); twice = answers that were not for their own text (a
duplicate delivered to the wrong caller; each HTTP request gets one response);
dup replies = results the gateway received for a request it had already
answered (shoal_gateway_duplicate_replies_total: at-least-once delivery,
recomputed work, dropped there); p99 before and during the fault (requests in
flight from the fault until recovery); max gap = the longest time without an
answer after the fault; recover s = from the fault until answers keep up with
the load again for good: from then on no request waits longer than 3 x the
pre-fault p99 (at least 1 s) for its answer. The load runs on this machine
too: on a busy one the sender stalls now and then and sends late requests in
a rush, which shows in the latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.faults_report import report, table
from bench.lib.faults_fleet import MODEL, Fleet, alive, fleet, fleet_stack, netns_unavailable
from bench.lib.faults_load import Load, verify

DEFAULT_JSON = Path("bench/out/faults.json")
CLUSTER_SCRIPT = Path(__file__).resolve().parent.parent / "infra" / "rabbitmq-cluster.sh"
# A cluster of its own (names, ports, folder), so that stopping a node never disturbs a
# cluster someone else runs with the script's defaults.
CLUSTER_NAME = "shoalfaults"
CLUSTER_ENV = {"SHOAL_CLUSTER_NAME": CLUSTER_NAME, "SHOAL_CLUSTER_DIR": "/tmp/shoal-faults-cluster",
               "SHOAL_CLUSTER_AMQP_BASE": "5780", "SHOAL_CLUSTER_DIST_BASE": "25780",
               "SHOAL_CLUSTER_MGMT_BASE": "15780"}
CLUSTER_PORTS = (5781, 5782, 5783)
NETNS_SCENARIOS = ("worker-link-cut", "worker-kill", "broker-restart")
SCENARIOS = (*NETNS_SCENARIOS, "broker-node-stop")

Scenario = Callable[[Fleet, Load, argparse.Namespace, dict[str, Any]], Awaitable[None]]


async def _poll(condition: Callable[[], Any], timeout: float, interval: float = 0.25
                ) -> bool:
    """Poll a blocking `condition` (in a thread) until truthy; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if await asyncio.to_thread(condition):
                return True
        await asyncio.sleep(interval)
    return False


async def _until(load: Load, at: float) -> None:
    await asyncio.sleep(max(0.0, at - load.now()))


async def worker_link_cut(fleet_: Fleet, load: Load, args: argparse.Namespace,
                          marks: dict[str, Any]) -> None:
    n = len(fleet_.workers)
    marks["fault"] = load.now()
    await asyncio.to_thread(fleet_.cut, "w1")
    # The broker noticed once the queue has one consumer fewer (w1's connection closed).
    if await _poll(lambda: (fleet_.consumers() or n) < n, args.fault):
        marks["detected"] = load.now()
    await _until(load, marks["fault"] + args.fault)
    marks["heal"] = load.now()
    await asyncio.to_thread(fleet_.heal, "w1")
    if await _poll(lambda: fleet_.consumers() == n, args.rejoin_timeout):
        marks["rejoined"] = load.now()
    # ...and answers again (the first answer from w1 to a request sent after the heal).
    w1 = fleet_.worker_name("w1")
    await _poll(lambda: any(s.worker.startswith(f"{w1}@") for s in load.shots
                            if s.sent >= marks["heal"]), args.rejoin_timeout)


async def worker_kill(fleet_: Fleet, load: Load, args: argparse.Namespace,
                      marks: dict[str, Any]) -> None:
    n = len(fleet_.workers)
    marks["fault"] = load.now()
    orphans = fleet_.kill_worker("w1")
    if await _poll(lambda: (fleet_.consumers() or n) < n, args.fault):
        marks["detected"] = load.now()
    # The runtime process of the killed worker must see its worker gone and exit.
    if await _poll(lambda: not any(alive(p) for p in orphans), args.fault):
        marks["runtime_exited"] = load.now()
    marks["runtime_pids"] = orphans
    await _until(load, marks["fault"] + args.fault)


async def broker_restart(fleet_: Fleet, load: Load, args: argparse.Namespace,
                         marks: dict[str, Any]) -> None:
    n = len(fleet_.workers)
    marks["fault"] = load.now()
    await asyncio.to_thread(fleet, "broker-stop")
    marks["broker_stopped"] = load.now()
    await asyncio.to_thread(fleet, "broker-start")
    marks["broker_started"] = load.now()
    if await _poll(lambda: fleet_.consumers() == n, args.rejoin_timeout):
        marks["rejoined"] = load.now()
    await _until(load, marks["fault"] + args.fault)


def _cluster(*args: str) -> str:
    """rabbitmq-cluster.sh's output. Through a file, not a pipe: a node it starts inherits
    the output, and a pipe would stay open (and this wait) as long as the node runs."""
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run(["bash", str(CLUSTER_SCRIPT), *args], stdout=out, stderr=out,
                              text=True, timeout=300, env={**os.environ, **CLUSTER_ENV})
        out.seek(0)
        text = out.read()
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmq-cluster.sh {' '.join(args)}: {text.strip()}")
    return text


def _queue_leader(queue: str) -> int | None:
    """Which cluster node (1-3) leads `queue` now."""
    match = re.search(rf"{CLUSTER_NAME}(\d)@", _cluster("leader", queue))
    return int(match.group(1)) if match else None


async def broker_node_stop(fleet_: Fleet, load: Load, args: argparse.Namespace,
                           marks: dict[str, Any]) -> None:
    node = await asyncio.to_thread(_queue_leader, fleet_.queue) or 1
    marks["node"] = node
    marks["fault"] = load.now()
    await asyncio.to_thread(_cluster, "stop-node", str(node))
    marks["node_stopped"] = load.now()
    await _until(load, marks["fault"] + args.fault)
    await asyncio.to_thread(_cluster, "start-node", str(node))
    marks["node_started"] = load.now()


RUNS: dict[str, Scenario] = {"worker-link-cut": worker_link_cut, "worker-kill": worker_kill,
                             "broker-restart": broker_restart,
                             "broker-node-stop": broker_node_stop}


async def drive(fleet_: Fleet, args: argparse.Namespace, seed: int,
                bar: Any) -> tuple[Load, dict[str, Any]]:
    load = Load(fleet_.url, MODEL, args.rate, args.deadline, seed)
    stop = asyncio.Event()
    total_s = args.warmup_timeout + args.before + args.fault + args.rejoin_timeout * 2 \
        + args.after + 60
    sender = asyncio.create_task(load.run(stop, int(args.rate * total_s)))
    marks: dict[str, Any] = {}
    try:
        bar.set_description(f"{args.scenario}: warming up")
        names = {fleet_.worker_name(h) for h in fleet_.workers}
        await asyncio.sleep(0.5)
        if not await _poll(lambda: names <= {w.partition("@")[0]
                                              for w in load.workers_seen()},
                           args.warmup_timeout):
            raise RuntimeError(f"not every worker answered within {args.warmup_timeout} s "
                               f"(seen: {load.workers_seen()}); logs in {fleet_.stack.log_dir}")
        marks["duplicates_before"] = await asyncio.to_thread(fleet_.duplicate_replies)
        await asyncio.sleep(args.before)
        if args.burst:  # the workers hold work when the fault comes
            marks["burst"] = load.now()
            load.burst(args.burst)
            await asyncio.sleep(args.burst_lead)
        bar.set_description(f"{args.scenario}: fault")
        await RUNS[args.scenario](fleet_, load, args, marks)
        bar.set_description(f"{args.scenario}: after")
        await asyncio.sleep(args.after)
        marks["load_end"] = load.now()
    finally:
        stop.set()
        bar.set_description(f"{args.scenario}: waiting for the last answers")
        await sender
    marks["duplicates_after"] = await asyncio.to_thread(fleet_.duplicate_replies)
    return load, marks


class _NoBar:
    def set_description(self, text: str) -> None:
        print(text, file=sys.stderr)


def run_once(args: argparse.Namespace, seed: int, bar: Any = None,
             log_dir: Path | None = None) -> dict[str, Any]:
    """One run on a fresh stack: its row of figures (`report`)."""
    bar = bar or _NoBar()
    netns = args.scenario in NETNS_SCENARIOS
    broker_url = None
    if not netns:
        broker_url = ";".join(f"amqp://guest:guest@127.0.0.1:{p}//" for p in CLUSTER_PORTS)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"shoal-faults-{args.scenario}-"))
    bar.set_description(f"{args.scenario}: starting the stack")
    with fleet_stack(log_dir, netns=netns, broker_url=broker_url,
                     heartbeat_s=args.heartbeat, log_level=args.log_level,
                     keep_fleet=args.keep_fleet) as fleet_:
        load, marks = asyncio.run(drive(fleet_, args, seed, bar))
        bar.set_description(f"{args.scenario}: checking answers")
        checked = None if args.no_verify else verify(load.shots)
        row = report(fleet_, load, marks, args, checked)
    row["log_dir"] = str(log_dir)
    return row


def command(args: argparse.Namespace) -> str:
    return (f"python -m bench.faults --scenario {args.scenario} --runs {args.runs} "
            f"--rate {args.rate:g} --before {args.before:g} --fault {args.fault:g} "
            f"--after {args.after:g} --burst {args.burst} --heartbeat {args.heartbeat:g}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--runs", type=int, default=1, help="runs, a fresh stack each")
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s (default 20)")
    parser.add_argument("--before", type=float, default=10.0,
                        help="seconds of steady state before the fault (default 10)")
    parser.add_argument("--fault", type=float, default=25.0,
                        help="seconds from the fault to the heal / restart (default 25)")
    parser.add_argument("--after", type=float, default=10.0,
                        help="seconds of load after it (default 10)")
    parser.add_argument("--burst", type=int, default=32,
                        help="requests sent at once --burst-lead seconds before the fault, "
                             "so that the workers hold work when it comes (default 32)")
    parser.add_argument("--burst-lead", type=float, default=0.3)
    parser.add_argument("--heartbeat", type=float, default=5.0,
                        help="SHOAL_BROKER_HEARTBEAT of every process (default 5)")
    parser.add_argument("--deadline", type=float, default=90.0,
                        help="X-Timeout-Ms of each request, in seconds (default 90)")
    parser.add_argument("--warmup-timeout", type=float, default=120.0)
    parser.add_argument("--rejoin-timeout", type=float, default=60.0)
    parser.add_argument("--log-level", default="warning", help="the workers' log level")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not check the embeddings against the model in-process")
    parser.add_argument("--keep-fleet", action="store_true",
                        help="leave the namespace fleet (or the 3-node cluster) up afterwards")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"write every run's figures here (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rate <= 0 or args.before <= 0 or args.fault <= 0 \
            or args.after < 0:
        parser.error("--runs >= 1, --rate, --before and --fault > 0, --after >= 0")
    return args


def check_preconditions(scenario: str) -> None:
    if scenario in NETNS_SCENARIOS:
        if why := netns_unavailable():
            raise SystemExit(f"{scenario} needs the namespace fleet: {why}")
    elif not CLUSTER_SCRIPT.exists():
        raise SystemExit(f"{scenario} needs {CLUSTER_SCRIPT} (the 3-node cluster)")


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from app.tuning.inproc import machine_info
    from bench.lib.output import emit

    args = parse_args(argv)
    check_preconditions(args.scenario)
    cluster = args.scenario == "broker-node-stop"
    if cluster:
        _cluster("start")
    rows = []
    try:
        with tqdm(total=args.runs, unit="run", file=sys.stderr) as bar:
            for run in range(args.runs):
                rows.append(run_once(args, seed=run, bar=bar))
                bar.update()
    finally:
        if cluster and not args.keep_fleet:
            _cluster("stop")
    print(f"`{command(args)}` ({os.cpu_count()} CPUs, MiniLM, single-text requests)\n")
    data = {"machine": machine_info(), "command": command(args), "scenario": args.scenario,
            "rows": rows}
    code = emit(table(args.scenario, rows), data, args.json)
    bad = sum(r["lost"] + (r["twice"] or 0) for r in rows)
    if bad:
        print(f"\nFAILED: {bad} requests lost or answered for another text; details in "
              f"{args.json}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
