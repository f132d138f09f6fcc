"""Head-of-line blocking: small requests' latency while one huge request runs.

    .venv/bin/python -m bench.hol --clients 4 --duration 15 --rounds 3

Real MiniLM through a private stack. Each round measures N closed-loop
clients sending one short text each, first alone ("without"), then while one
request of `--big-items` texts of `--big-chars` characters each is being
computed ("with"; it is sent first and the window starts once its first
part runs, so the whole window lies inside it). shoal splits the big request
into parts (`tasks.split`, `batching.parts`) that the scheduler interleaves
with the small ones; the ratio p99 with / p99 without says how much the big
request still costs everyone else. `--env SHOAL_PART_TARGET_MS=...` changes
the part size; a huge value keeps parts at the batch budget.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import uvloop
from tqdm import tqdm

from app.tuning import markdown
from app.tuning.bench_stack import bench_stack
from app.tuning.inproc import machine_info
from app.tuning.load import LoadResult, prepare, run_load
from app.tuning.mix import make_texts
from bench.lib.args import add_env, env_of
from bench.lib.minilm import MINILM
from bench.lib.output import emit


def big_body(items: int, chars: int) -> dict[str, Any]:
    words = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do " * (chars // 60 + 1))
    return {"items": [{"text": f"{i} {words}"[:chars]} for i in range(items)]}


async def _window(endpoint: str, small: list, clients: int, args: argparse.Namespace,
                  pids: list[int]) -> LoadResult:
    return await run_load(endpoint, small, "closed", clients, warmup=args.warmup,
                          duration=args.duration, cpu_pids=pids)


async def _with_big(endpoint: str, small: list, args: argparse.Namespace,
                    pids: list[int]) -> tuple[LoadResult, dict[str, Any]]:
    body = big_body(args.big_items, args.big_chars)
    async with httpx.AsyncClient(timeout=args.big_timeout_s) as client:
        started = time.perf_counter()
        big = asyncio.create_task(client.post(
            endpoint, json=body, headers={"x-timeout-ms": str(int(args.big_timeout_s * 1000))}))
        await asyncio.sleep(args.big_lead_s)  # the body is uploaded and its first part runs
        if big.done():
            raise SystemExit("the big request ended before the window: raise --big-items")
        load = await _window(endpoint, small, args.clients, args, pids)
        if big.done():
            raise SystemExit("the big request ended inside the window: raise --big-items "
                             "or lower --duration")
        response = await big
        seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise SystemExit(f"the big request failed: {response.status_code} {response.text}")
    return load, {"seconds": seconds, "parts": int(response.headers.get("x-batch-parts", "1")),
                  "inference_ms": float(response.headers.get("x-inference-time-ms", "0"))}


def _row(load: LoadResult) -> dict[str, Any]:
    return {"req_per_s": load.req_per_s, "p50_ms": load.p50_ms, "p99_ms": load.p99_ms,
            "errors": load.errors}


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = env_of(args.env)
    rounds: list[dict[str, Any]] = []
    with bench_stack(MINILM, env) as stack:
        endpoint = f"{stack.url}/v1/encode/{MINILM}"
        small = prepare(endpoint, [[t] for t in make_texts(200)])
        with tqdm(total=args.rounds * 2, desc="head-of-line", file=sys.stderr) as bar:
            for _ in range(args.rounds):
                without = uvloop.run(_window(endpoint, small, args.clients, args, stack.pids))
                bar.update()
                loaded, big = uvloop.run(_with_big(endpoint, small, args,
                                                   stack.pids))
                bar.update()
                rounds.append({"without": _row(without), "with": _row(loaded), "big": big,
                               "p99_ratio": loaded.p99_ms / without.p99_ms
                               if loaded.p99_ms and without.p99_ms else None})
    ratios = [r["p99_ratio"] for r in rounds if r["p99_ratio"] is not None]
    return {"machine": machine_info(), "args": vars(args) | {"env": env}, "rounds": rounds,
            "median_p99_ratio": statistics.median(ratios) if ratios else None}


_ms = partial(markdown.dash, spec=".1f")


def table(result: dict[str, Any]) -> str:
    rows = []
    for i, r in enumerate(result["rounds"], 1):
        a, b = r["without"], r["with"]
        ratio = "-" if r["p99_ratio"] is None else f"{r['p99_ratio']:.2f}"
        rows.append([i, _ms(a["p50_ms"]), _ms(a["p99_ms"]), _ms(b["p50_ms"]), _ms(b["p99_ms"]),
                     ratio, b["errors"], f"{r['big']['seconds']:.1f}", r["big"]["parts"]])
    lines = markdown.table(["round", "p50 without", "p99 without", "p50 with", "p99 with",
                            "p99 ratio", "errors with", "big request s", "parts"], rows,
                           align="l" * 9)
    median = result["median_p99_ratio"]
    lines.append("\nmedian p99 ratio (with / without): "
                 + ("- (no small request succeeded while the big one ran)" if median is None
                    else f"{median:.2f}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hol", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-items", type=int, default=512)
    parser.add_argument("--big-chars", type=int, default=8000)
    parser.add_argument("--big-lead-s", type=float, default=2.0,
                        help="seconds between sending the big request and the window")
    parser.add_argument("--big-timeout-s", type=float, default=300.0)
    add_env(parser, "worker and gateway settings (repeatable)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = run(args)
    return emit(table(result), result, args.json)


if __name__ == "__main__":
    sys.exit(main())
