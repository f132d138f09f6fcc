"""End-to-end benchmark: the model's in-process ceiling, then closed-loop HTTP load.

Run against an already-running stack (gateway, worker, RabbitMQ):

    .venv/bin/python -m bench.e2e --clients 1,8,32,64 --duration 10 \
        --pids "$(pgrep -f 'shoal gateway'),$(pgrep -f 'shoal worker'),$(pgrep -f beam.smp)"

The in-process part times `DenseEncoder.encode` on the same texts the HTTP
clients send, so each HTTP level can be read as a fraction of what the model
alone does on this machine. The model is freed before the HTTP load starts.
Each HTTP level is `app.tuning.load`'s closed loop, one text per request.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop

from app.tuning.inproc import inproc_throughput, machine_info, medians
from app.tuning.load import LoadResult, prepare, run_load
from app.tuning.markdown import fmt, table
from app.tuning.mix import make_texts
from app.tuning.stack import gateway_ready
from bench.lib.args import add_env, env_of, int_list

if TYPE_CHECKING:
    pass


# --------------------------------------------------------------------------- report


def pct(value: float, ceiling: float | None) -> str:
    return f"{100 * value / ceiling:.0f}%" if ceiling else "n/a"


def inproc_table(inproc: dict[int, float], passes: dict[int, list[float]]) -> list[str]:
    lines = table(["batch", "sentences/s (median)", "min", "max"], [
        [size, f"{rate:.1f}", f"{min(passes[size]):.1f}", f"{max(passes[size]):.1f}"]
        for size, rate in inproc.items()
    ])
    if inproc:
        best = max(inproc, key=inproc.__getitem__)
        b32 = fmt(inproc.get(32))
        lines += ["", f"Batch 32: {b32} sentences/s. Best: batch {best} at {inproc[best]:.1f}."]
    return lines


def http_table(levels: list[LoadResult], inproc: dict[int, float]) -> list[str]:
    b32, best = inproc.get(32), max(inproc.values(), default=None)
    return table(
        ["clients", "req/s", "% of b32", "% of best", "p50 ms", "p99 ms", "median batch",
         "errors"],
        [[f"{r.offered:g}", f"{r.req_per_s:.1f}", pct(r.req_per_s, b32), pct(r.req_per_s, best),
          fmt(r.p50_ms), fmt(r.p99_ms), fmt(r.median_batch_requests, "g"), r.errors]
         for r in levels])


def cpu_table(levels: list[LoadResult]) -> list[str]:
    names = list(dict.fromkeys(n for r in levels for n in r.cpu_ms_per_request))
    if not names:
        return []
    return table(["clients", *names, "bench client"],
                 [[f"{r.offered:g}", *(fmt(r.cpu_ms_per_request.get(n), ".2f") for n in names),
                   fmt(r.client_cpu_ms_per_request, ".2f")] for r in levels])


def report(
    meta: dict[str, object], passes: dict[int, list[float]], levels: list[LoadResult]
) -> str:
    inproc = medians(passes)
    m = meta["machine"]
    assert isinstance(m, dict)
    lines = [
        "# shoal end-to-end benchmark",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- machine: nproc={m['nproc']}, CPU: {m['cpu_model']}, "
        f"torch threads (this process): {m['torch_threads']}",
        f"- gateway: {meta['url']}, model: {meta['model']}, "
        f"{meta['duration']} s per level after {meta['warmup']} s warm-up",
        "",
        "## In-process ceiling (DenseEncoder.encode, same texts)",
        "",
        *inproc_table(inproc, passes),
        "",
        "## HTTP closed loop (one text per request)",
        "",
        *http_table(levels, inproc),
    ]
    kinds = {int(r.offered): r.error_kinds for r in levels if r.error_kinds}
    if kinds:
        lines += ["", f"Errors by kind (per client count): {kinds}"]
    warm = {int(r.offered): r.warmup_errors for r in levels if r.warmup_errors}
    if warm:
        lines += ["", f"Errors during warm-up, not counted above (per client count): {warm}"]
    cpu = cpu_table(levels)
    if cpu:
        lines += ["", "## CPU ms per request (utime+stime over the measured window)", "", *cpu]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL")
    p.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    p.add_argument("--clients", type=int_list, default=[1, 8, 32, 64],
                   help="comma-separated concurrent client counts (default 1,8,32,64)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=2.0, help="uncounted seconds before each level")
    p.add_argument("--inproc-batches", type=int_list, default=[1, 8, 32, 64],
                   help="comma-separated in-process batch sizes (default 1,8,32,64)")
    p.add_argument("--inproc-reps", type=int, default=3, help="timed passes per batch size")
    p.add_argument("--texts", type=int, default=200, help="number of distinct texts")
    p.add_argument("--seed", type=int, default=0, help="seed for the generated texts")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout, seconds")
    p.add_argument("--pids", type=int_list, default=[],
                   help="comma-separated PIDs (gateway, worker, broker) to account CPU for")
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    p.add_argument("--start-stack", action="store_true",
                   help="start a private worker + gateway for this run (ignores --url)")
    add_env(p, "extra environment for --start-stack (repeatable)")
    args = p.parse_args(argv)
    if args.inproc_reps < 1 or args.texts < 1 or args.duration <= 0 or args.warmup < 0:
        p.error("--inproc-reps and --texts must be >= 1, --duration > 0, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.start_stack:
        return run(args)
    from app.tuning.bench_stack import bench_stack

    print("starting a private stack...", file=sys.stderr)
    extra_env = env_of(args.env)
    with bench_stack(args.model, extra_env) as stack:
        args.url = stack.url
        args.pids = [*stack.pids, *args.pids]
        return run(args)


def run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    missing = [pid for pid in args.pids if not Path(f"/proc/{pid}/stat").exists()]
    if missing:
        print(f"error: no such process(es): {missing}", file=sys.stderr)
        return 2
    why = gateway_ready(url)
    if why is not None:
        print(f"error: the gateway at {url} is not ready ({why}); start it with "
              "`.venv/bin/shoal gateway` and a worker with `.venv/bin/shoal worker`",
              file=sys.stderr)
        return 2

    meta: dict[str, object] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "bench.e2e", *sys.argv[1:]]),
        "machine": machine_info(),
        "url": url,
        "model": args.model,
        "duration": args.duration,
        "warmup": args.warmup,
    }
    texts = make_texts(args.texts, args.seed)
    print("in-process ceiling...", file=sys.stderr)
    passes = inproc_throughput(texts, args.inproc_batches, args.inproc_reps)

    endpoint = f"{url}/v1/encode/{args.model}"
    prepared = prepare(endpoint, [[text] for text in texts])
    levels: list[LoadResult] = []
    for clients in args.clients:
        print(f"HTTP load, {clients} clients...", file=sys.stderr)
        level = uvloop.run(run_load(endpoint, prepared, "closed", clients, warmup=args.warmup,
                                    duration=args.duration, timeout=args.timeout,
                                    cpu_pids=args.pids))
        print(f"  {level.req_per_s:.1f} req/s, {level.errors} errors", file=sys.stderr)
        levels.append(level)

    print(report(meta, passes, levels))
    if args.json:
        raw = {**meta, "texts": len(texts), "inproc_sentences_per_s": medians(passes),
               "inproc_passes": passes,
               "levels": [asdict(r) | {"clients": int(r.offered)} for r in levels]}
        args.json.write_text(json.dumps(raw, indent=2) + "\n")
    if not any(r.requests for r in levels):
        print(f"error: every request to {endpoint} failed; is the gateway (and a worker "
              "serving this model) up?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
