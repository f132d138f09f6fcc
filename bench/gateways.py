"""One gateway process against several (`shoal gateway --workers N`), same load, one run.

    .venv/bin/python -m bench.gateways --rounds 3 --duration 8 [--gateways 1,2] [--json out.json]

Each level is a fresh private stack (`app.tuning.bench_stack.bench_stack`): a shoal worker
with the sim runtime at zero cost (so the model costs nothing and the pipeline
is what is measured), a gateway of N processes, `--clients` closed-loop
clients each sending one text per request (`app.tuning.load.run_load`). The levels
alternate within a round and their order flips every round, so drift over the
run (a warming broker, a noisy neighbour) falls on every level alike.

Reported per level (medians over rounds): req/s, p50/p99 latency, requests per
worker batch (X-Batch-Requests), and CPU ms per request of each gateway process,
of the gateway as a whole (its processes plus uvicorn's supervisor), the worker
(with its runtime process), RabbitMQ and the load client. Everything runs on
this machine: when it has fewer cores than gateway processes + worker + broker
+ client can use, the levels compete for the same cores and a gain from more
gateway processes cannot show. Which process serves a keep-alive connection is
the kernel's choice when it is accepted, so the split need not be even.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.stats import median
from bench.lib.minilm import MINILM

ZERO_COST_SIM = {"SHOAL_RUNTIME": "sim", "SHOAL_SIM_COST_A_MS": "0", "SHOAL_SIM_COST_B_US": "0",
                 "SHOAL_SIM_COST_C_NS": "0"}
_PID = re.compile(r"\((\d+)\)$")


def schedule(rounds: int, levels: Sequence[int]) -> list[tuple[int, int]]:
    """(round, gateway processes) in running order: each round has every level, in the
    given order on even rounds and reversed on odd ones."""
    return [(r, n) for r in range(rounds) for n in (levels if r % 2 == 0 else levels[::-1])]


def cpu_roles(cpu_ms: dict[str, float], gateway_pids: Sequence[int]) -> dict[str, Any]:
    """app.tuning.cpu's per-process CPU ms/request, by role: each gateway process (in
    `gateway_pids` order), the supervisor, worker (+ runtime), broker, total."""
    roles: dict[str, Any] = {"gateway_processes": [0.0] * len(gateway_pids),
                             "gateway_supervisor": 0.0, "worker": 0.0, "broker": 0.0,
                             "other": 0.0, "total": cpu_ms.get("total")}
    for label, ms in cpu_ms.items():
        match = _PID.search(label)
        if label == "total" or match is None:
            continue
        pid = int(match.group(1))
        if pid in gateway_pids:
            roles["gateway_processes"][list(gateway_pids).index(pid)] += ms
        elif label.startswith("shoal gateway"):
            roles["gateway_supervisor"] += ms
        elif label.startswith(("shoal worker", "runtime")):
            roles["worker"] += ms
        elif label.startswith("beam.smp"):
            roles["broker"] += ms
        else:  # multiprocessing's resource tracker
            roles["other"] += ms
    roles["gateway"] = sum(roles["gateway_processes"]) + roles["gateway_supervisor"]
    return roles


def measure(gateways: int, round_: int, texts: list[str], args: argparse.Namespace
            ) -> dict[str, Any]:
    import uvloop

    from app.tuning.bench_stack import bench_stack
    from app.tuning.load import prepare, run_load

    # A prefix per stack: the next stack never sees this one's reply queues.
    prefix = f"shoal-bench-gw-{os.getpid()}-{round_}-{gateways}"
    with bench_stack(MINILM, extra_env=ZERO_COST_SIM, prefix=prefix,
                     gateway_workers=gateways) as running:
        endpoint = f"{running.url}/v1/encode/{MINILM}"
        prepared = prepare(endpoint, [[text] for text in texts])
        level = uvloop.run(run_load(endpoint, prepared, "closed", args.clients,
                                    warmup=args.warmup, duration=args.duration,
                                    cpu_pids=running.pids))
        gateway_pids = list(running.gateway_pids)
    return {"gateways": gateways, "round": round_, **asdict(level),
            "cpu": cpu_roles(level.cpu_ms_per_request, gateway_pids)}


def summarise(runs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per gateway count: the median over rounds of each figure, and the req/s range."""
    summary = {}
    for n in sorted({run["gateways"] for run in runs}):
        mine = [run for run in runs if run["gateways"] == n]
        rates = [run["req_per_s"] for run in mine]
        summary[n] = {
            "rounds": len(mine),
            "req_per_s": statistics.median(rates), "req_per_s_min": min(rates),
            "req_per_s_max": max(rates),
            "p50_ms": median([run["p50_ms"] for run in mine]),
            "p99_ms": median([run["p99_ms"] for run in mine]),
            "errors": sum(run["errors"] for run in mine),
            "batch_requests": median([run["median_batch_requests"] for run in mine]),
            "cpu_gateway_processes": [
                median([run["cpu"]["gateway_processes"][i] for run in mine])
                for i in range(n)],
            **{f"cpu_{role}": median([run["cpu"][role] for run in mine])
               for role in ("gateway", "gateway_supervisor", "worker", "broker", "total")},
            "cpu_client": median([run["client_cpu_ms_per_request"] for run in mine]),
        }
    return summary


def _f(value: float | None, spec: str = ".2f") -> str:
    return markdown.dash(value, spec)


def report(data: dict[str, Any]) -> str:
    lines = [
        f"`python -m bench.gateways --rounds {data['rounds']} --duration {data['duration']} "
        f"--clients {data['clients']}`: zero-cost sim worker, {data['clients']} closed-loop "
        f"clients, one text per request; {data['nproc']} cores ({data['cpu_model']}), "
        "shared by gateway, worker, RabbitMQ and the load client. Medians over rounds.",
        "",
        *markdown.table(
            ["gateway processes", "req/s (min-max)", "p50 ms", "p99 ms", "errors",
             "requests/batch", "CPU ms/req: each gateway process", "gateway total",
             "worker + runtime", "RabbitMQ", "stack total", "load client"],
            [[n, f"{s['req_per_s']:.0f} ({s['req_per_s_min']:.0f}-{s['req_per_s_max']:.0f})",
              _f(s["p50_ms"], ".1f"), _f(s["p99_ms"], ".1f"), s["errors"],
              _f(s["batch_requests"], ".0f"),
              " / ".join(_f(v) for v in s["cpu_gateway_processes"]), _f(s["cpu_gateway"]),
              _f(s["cpu_worker"]), _f(s["cpu_broker"]), _f(s["cpu_total"]),
              _f(s["cpu_client"])] for n, s in data["summary"].items()],
            align="rrrrrrlrrrrr"),
        "", "Each run, in order:", "",
        *markdown.table(
            ["round", "gateway processes", "req/s", "p50 ms", "p99 ms", "gateway CPU ms/req"],
            [[run["round"] + 1, run["gateways"], f"{run['req_per_s']:.0f}",
              _f(run["p50_ms"], ".1f"), _f(run["p99_ms"], ".1f"), _f(run["cpu"]["gateway"])]
             for run in data["runs"]]),
    ]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from app.tuning.mix import make_texts

    texts = make_texts(200)
    plan = schedule(args.rounds, args.gateways)
    runs = []
    with tqdm(total=len(plan), unit="level", desc="bench.gateways", file=sys.stderr) as bar:
        for round_, n in plan:
            bar.set_description(f"round {round_ + 1}: {n} gateway process(es)")
            runs.append(measure(n, round_, texts, args))
            bar.set_postfix_str(f"{runs[-1]['req_per_s']:.0f} req/s")
            bar.update()
    return {"nproc": os.cpu_count(), "cpu_model": _cpu_model(), "clients": args.clients,
            "duration": args.duration, "warmup": args.warmup, "rounds": args.rounds,
            "gateways": args.gateways, "runs": runs, "summary": summarise(runs)}


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated counts: {text!r}") from None
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"distinct counts >= 1 expected, got {text!r}")
    return levels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gateways", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateways", type=_levels, default=[1, 2],
                        help="gateway process counts to compare (default 1,2)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.clients < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--rounds and --clients must be >= 1, --duration > 0, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    from bench.lib.output import emit

    args = parse_args(argv)
    data = run(args)
    return emit(report(data), data, args.json)


if __name__ == "__main__":
    sys.exit(main())
