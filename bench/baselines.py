"""shoal against its baselines, in one run, on the same texts and the same load.

    .venv/bin/python -m bench.baselines --clients 32 --duration 8 [--json out.json]

1. the model in process at batch 1 and 32 (the ceiling; `DenseEncoder`);
2. shoal: gateway -> RabbitMQ -> shoal worker (batching) -> runtime;
3. the naive Celery deployment (`bench.naive_celery`): the same gateway and
   queue, a prefork Celery worker running one task per request;
4. the pipeline without a model: shoal with the `sim` runtime at zero cost,
   one text and eight texts per request (requests/s and items/s the
   gateway, broker and worker can carry);
5. a plain aio-pika publish -> consume -> reply loop (`bench.amqp_loop`), the
   broker's practical limit on this machine.

Every HTTP level is N closed-loop clients (`app.tuning.load.run_load`). The peer
server users pick instead (Infinity) is measured by `bench.peers`
(`make bench-peers` installs it in a venv of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import uvloop

from app.tuning.bench_stack import bench_stack
from app.tuning.inproc import inproc_throughput, machine_info, medians
from app.tuning.load import prepare, run_load
from app.tuning.markdown import fmt, table
from app.tuning.mix import make_texts
from bench.amqp_loop import run_loop
from bench.lib.output import emit

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
NAIVE_WORKER = [sys.executable, "-m", "celery", "-A", "bench.naive_celery", "worker",
                "--pool", "prefork", "--concurrency", "1", "--loglevel", "warning"]
ZERO_COST_SIM = {"SHOAL_RUNTIME": "sim", "SHOAL_SIM_COST_A_MS": "0", "SHOAL_SIM_COST_B_US": "0",
                 "SHOAL_SIM_COST_C_NS": "0"}


def _http(name: str, texts: list[str], args: argparse.Namespace, items: int = 1,
          **stack: Any) -> dict[str, Any]:
    with bench_stack(MINILM, **stack) as running:
        endpoint = f"{running.url}/v1/encode/{MINILM}"
        prepared = prepare(endpoint, [[text] * items for text in texts])
        level = uvloop.run(run_load(endpoint, prepared, "closed", args.clients,
                                    warmup=args.warmup, duration=args.duration,
                                    cpu_pids=running.pids))
    result = asdict(level)
    result.update(name=name, items_per_request=items)
    print(f"  {name}: {level.req_per_s:.0f} req/s", file=sys.stderr)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    texts = make_texts(200)
    ceiling = medians(inproc_throughput(texts, [1, 32], args.reps))
    print(f"  in process: {ceiling[1]:.0f} -> {ceiling[32]:.0f} items/s", file=sys.stderr)
    levels = [
        _http("shoal", texts, args),
        # A Celery worker reads one task a message: the gateway must not coalesce for it.
        _http("naive Celery (prefork, 1 process)", texts, args, worker_argv=NAIVE_WORKER,
              extra_env={"SHOAL_COALESCE": "false"}),
        _http("shoal, sim runtime at zero cost", texts, args, extra_env=ZERO_COST_SIM),
        _http("shoal, sim runtime at zero cost", texts, args, items=8,
              extra_env=ZERO_COST_SIM),
    ]
    loop = asyncio.run(run_loop(args.clients, args.duration))
    print(f"  aio-pika loop: {loop.per_s:.0f} round trips/s", file=sys.stderr)
    return {"machine": machine_info(), "clients": args.clients, "duration": args.duration,
            "in_process": ceiling, "levels": levels, "amqp_loop": asdict(loop)}


def report(data: dict[str, Any]) -> str:
    ceiling = data["in_process"][32]
    lines = [
        f"`python -m bench.baselines --clients {data['clients']} --duration {data['duration']}`",
        "",
        f"In process (`DenseEncoder`): {data['in_process'][1]:.0f} items/s at batch 1, "
        f"{ceiling:.0f} at batch 32.",
        "",
    ]
    rows = []
    for level in data["levels"]:
        cpu = level["cpu_ms_per_request"].get("total")
        rows.append([level["name"], level["items_per_request"], f"{level['req_per_s']:.0f}",
                     f"{level['items_per_s']:.0f}", f"{level['items_per_s'] / ceiling:.0%}",
                     f"{level['p50_ms'] or 0:.0f}", f"{level['p99_ms'] or 0:.0f}",
                     level["median_batch_requests"] or "-", fmt(cpu, ".1f", missing="-")])
    loop = data["amqp_loop"]
    rows.append([f"plain aio-pika publish→consume→reply ({loop['queue_type']})", "-",
                 f"{loop['per_s']:.0f}", "-", "-", f"{loop['p50_ms']:.1f}",
                 f"{loop['p99_ms']:.1f}", "-", "-"])
    lines += table(["deployment", "items/request", "req/s", "items/s", "of in-process batch 32",
                    "p50 ms", "p99 ms", "requests/batch", "CPU ms/request"], rows, align="l" * 9)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baselines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    data = run(args)
    return emit(report(data), data, args.json)


if __name__ == "__main__":
    sys.exit(main())
