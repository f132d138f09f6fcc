"""shoal against its baselines, in one run, on the same texts and the same load.

    .venv/bin/python -m bench.baselines --clients 32 --duration 8 [--json out.json]

1. the model in process at batch 1, 32 and 128 (the best is the ceiling), on the engine
   shoal's stack serves MiniLM with (`--engine auto`: its cpu profile's, ONNX Runtime
   fp32, unless SHOAL_RUNTIME says otherwise; PyTorch: `DenseEncoder`; ONNX Runtime:
   `ModelHost`, one encode request of N texts a batch, as `bench.onnx_inprocess`);
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
from bench.lib.minilm import MINILM
from bench.lib.output import emit

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


SIZES = [1, 32, 128]


def served_engine(asked: str) -> str:
    """The engine the bench stack serves MiniLM with: `asked`, or for auto the one the
    worker picks (`app.worker.runtime.runtime_of_models`: SHOAL_RUNTIME, else the cpu
    profile's)."""
    if asked != "auto":
        return asked
    from app.worker.runtime import runtime_of_models, worker_runtime
    from tasks.catalog import load_catalog
    from tasks.settings import get_settings

    settings = get_settings()
    entry = load_catalog(settings.catalog_dir).get(MINILM)
    return runtime_of_models([entry], worker_runtime(settings), settings.device)[MINILM]


def onnx_inproc(texts: list[str], sizes: list[int], reps: int) -> dict[int, list[float]]:
    """As `inproc_throughput`, on ONNX Runtime fp32 through `ModelHost`."""
    import time

    from bench.onnx_inprocess import _encode, batches
    from runtimes.child_side.host import ModelHost
    from tasks.catalog import load_catalog
    from tasks.settings import get_settings

    entry = load_catalog(get_settings().catalog_dir).get(MINILM)
    model_id, host = entry.id, ModelHost(engine="onnx", precision="fp32")
    host.load_one(entry)  # exports a missing graph first (child process), untimed
    results: dict[int, list[float]] = {}
    for size in sizes:
        cut = batches(texts, size)
        for batch in cut:  # warm-up pass
            _encode(host, model_id, batch)
        results[size] = []
        for _ in range(reps):
            started = time.perf_counter()
            for batch in cut:
                _encode(host, model_id, batch)
            results[size].append(sum(map(len, cut)) / (time.perf_counter() - started))
        print(f"  in-process ORT fp32 batch {size:>3}: "
              f"{', '.join(f'{r:.1f}' for r in results[size])} sentences/s", file=sys.stderr)
    host.close()
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    texts = make_texts(200)
    engine = served_engine(args.engine)
    passes = onnx_inproc(texts, SIZES, args.reps) if engine == "onnx" else \
        inproc_throughput(texts, SIZES, args.reps)
    ceiling = medians(passes)
    print(f"  in process ({engine}): {ceiling}", file=sys.stderr)
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
            "engine": engine, "in_process": ceiling, "levels": levels,
            "amqp_loop": asdict(loop)}


def report(data: dict[str, Any]) -> str:
    inproc = {int(size): rate for size, rate in data["in_process"].items()}
    best = max(inproc, key=lambda size: inproc[size])
    ceiling = inproc[best]
    lines = [
        f"`python -m bench.baselines --clients {data['clients']} --duration {data['duration']}`",
        "",
        f"In process ({data.get('engine', 'pytorch')}): "
        + ", ".join(f"{rate:.0f} items/s at batch {size}" for size, rate in inproc.items())
        + f"; the best, batch {best}, is the ceiling.",
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
    lines += table(["deployment", "items/request", "req/s", "items/s", "of best in-process batch",
                    "p50 ms", "p99 ms", "requests/batch", "CPU ms/request"], rows, align="l" * 9)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baselines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engine", choices=["auto", "pytorch", "onnx"], default="auto",
                        help="the in-process ceiling's engine (auto: the one the stack serves "
                        "MiniLM with)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    data = run(args)
    return emit(report(data), data, args.json)


if __name__ == "__main__":
    sys.exit(main())
