"""The gateway's CPU per request and per text, this tree against another, alternating.

    .venv/bin/python -m bench.gateway_cpu --before 3917314 --rounds 3

Each round starts a private stack (gateway, worker, the zero-cost `sim` runtime: the
model costs nothing, so what is measured is the path around it) from each tree in
turn, and runs closed-loop clients at each load (`--loads`: clients x texts per
request, `POST /v1/encode/{model}` with JSON bodies, or with `--route embeddings` OpenAI's
`POST /v1/embeddings`; the raw keep-alive client). The
CPU of each process over the measured window comes from /proc. Reported: medians over
the rounds of the gateway's CPU per request and per text, requests/s, and the whole
stack's CPU per request (gateway, worker, RabbitMQ).

`--before REV` checks REV out in a temporary git worktree and runs its stacks from
there (PYTHONPATH): the same virtualenv, another tree's code.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.tuning import markdown
from app.tuning.inproc import machine_info
from app.tuning.mix import make_texts
from bench.baselines import ZERO_COST_SIM
from bench.gateways import cpu_roles
from bench.lib.minilm import MINILM
from bench.lib.output import emit
from bench.lib.trees import ROOT, worktree


def _loads(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CLIENTSxTEXTS,... got {text!r}") from None
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected CLIENTSxTEXTS,... got {text!r}")
    return [(p[0], p[1]) for p in pairs]


def measure_tree(tree: Path, loads: list[tuple[int, int]], args: argparse.Namespace
                 ) -> list[dict[str, Any]]:
    """One stack from `tree`, every load once: a child process, so that it imports that
    tree's code (this file runs as a script there, from the tree's folder: `-m` would put
    the folder first on the path, and the tree may predate this file)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(Path(__file__).resolve()), "--child",
               "--loads", ",".join(f"{c}x{t}" for c, t in loads),
               "--duration", str(args.duration), "--warmup", str(args.warmup),
               "--route", args.route]
    out = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"the stack of {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace) -> None:
    """In the tree under test: one stack, each load, one JSON line of results."""
    import json

    import uvloop

    from app.tuning.bench_stack import bench_stack
    from app.tuning.load import items_body, prepare, run_load

    texts = make_texts(512, seed=1)
    rows = []
    with bench_stack(MINILM, extra_env=ZERO_COST_SIM) as running:
        if args.route == "embeddings":
            endpoint = f"{running.url}/v1/embeddings"
            body = functools.partial(_embeddings_body, MINILM)
        else:
            endpoint = f"{running.url}/v1/encode/{MINILM}"
            body = items_body
        for clients, per_request in args.loads:
            requests = [texts[i:i + per_request] for i in range(0, len(texts) - per_request,
                                                                 max(1, per_request // 2))]
            level = uvloop.run(run_load(endpoint, prepare(endpoint, requests, body), "closed",
                                        clients, warmup=args.warmup, duration=args.duration,
                                        cpu_pids=running.pids))
            roles = cpu_roles(level.cpu_ms_per_request, list(running.gateway_pids))
            rows.append({"clients": clients, "texts": per_request,
                         "req_per_s": level.req_per_s, "errors": level.errors,
                         "gateway_ms": roles["gateway"], "worker_ms": roles["worker"],
                         "broker_ms": roles["broker"], "total_ms": roles["total"]})
    print(json.dumps(rows))


def _embeddings_body(model: str, texts: list[str]) -> dict[str, Any]:
    return {"model": model, "input": texts}


def run(args: argparse.Namespace) -> dict[str, Any]:
    trees: dict[str, Path] = {"this tree": ROOT}
    with contextlib.ExitStack() as stack:
        if args.before:
            trees = {f"before ({args.before})": stack.enter_context(worktree(args.before)),
                     **trees}
        runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in trees}
        order = list(trees.items())
        with tqdm(total=args.rounds * len(order), desc="gateway CPU", file=sys.stderr) as bar:
            for round_ in range(args.rounds):
                for name, tree in (order if round_ % 2 == 0 else order[::-1]):
                    runs[name].append(measure_tree(tree, args.loads, args))
                    bar.update()
    summary = {}
    for name, rounds in runs.items():
        for index, (clients, texts) in enumerate(args.loads):
            rows = [r[index] for r in rounds]
            gateway = statistics.median(r["gateway_ms"] for r in rows) * 1000
            summary[f"{name}|{clients}x{texts}"] = {
                "tree": name, "clients": clients, "texts": texts,
                "req_per_s": statistics.median(r["req_per_s"] for r in rows),
                "gateway_us_per_request": gateway, "gateway_us_per_text": gateway / texts,
                "gateway_us_runs": [round(r["gateway_ms"] * 1000) for r in rows],
                "total_ms_per_request": statistics.median(r["total_ms"] for r in rows),
                "errors": sum(r["errors"] for r in rows)}
    return {"machine": machine_info(), "args": {**vars(args), "loads": args.loads},
            "runs": runs, "summary": summary}


def table(result: dict[str, Any]) -> str:
    rows = [[s["tree"], f"{s['clients']} x {s['texts']}", f"{s['req_per_s']:.0f}",
             f"{s['gateway_us_per_request']:.0f}", f"{s['gateway_us_per_text']:.0f}",
             ", ".join(str(v) for v in s["gateway_us_runs"]),
             f"{s['total_ms_per_request'] * 1000:.0f}", str(s["errors"])]
            for s in sorted(result["summary"].values(),
                            key=lambda s: (s["clients"], s["texts"], s["tree"]))]
    return "\n".join(markdown.table(
        ["tree", "clients x texts", "req/s", "gateway µs/request", "gateway µs/text",
         "gateway µs/request, each round", "stack µs/request", "errors"],
        rows, align="llrrrlrr"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", type=_loads, default=_loads("1x1,8x1,32x1,32x16"),
                        help="CLIENTSxTEXTS,... (default 1x1,8x1,32x1,32x16)")
    parser.add_argument("--before", help="a git revision to compare with, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--route", choices=("encode", "embeddings"), default="encode",
                        help="the native POST /v1/encode/{model} or OpenAI's /v1/embeddings")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per load")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds before each")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    result = run(args)
    return emit(table(result), result, args.json)


if __name__ == "__main__":
    sys.exit(main())
