"""Callers beside a bulk job: do interactive requests keep their latency? (issue 29)

    .venv/bin/python -m bench.bulk_interference [--texts 20000] [--clients 2]
        [--duration 20] [--rounds 1] [--env NAME=VALUE]

One stack (`app.tuning.bench_stack.bench_stack`: gateway + one worker serving the packaged MiniLM on
this CPU). Per round, three phases, each on the idle stack:

1. **callers alone**: `--clients` closed-loop clients, one short text per request, for
   `--duration` s: p50/p99 latency;
2. **the job alone**: a bulk job of `--texts` texts (`POST /v1/jobs`, NDJSON), from its 202
   until it reads `succeeded`: texts/s;
3. **both**: the same job, and the same clients from its 202 for `--duration` s (or until
   the job ends, if sooner): the clients' p50/p99, and the job's texts/s.

The table gives, per phase, the median over rounds, and the two ratios the issue sets
targets for: callers' p99 with the job over without (target <= 1.5), and the job's texts/s
beside the callers over alone (target >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

import httpx

from app.tuning.bench_stack import bench_stack
from app.tuning.load import LoadResult, prepare, run_load
from app.tuning.markdown import table
from app.tuning.mix import make_texts
from bench.lib.args import add_env, env_of
from bench.lib.minilm import MINILM

POLL_S = 0.2
P99_TARGET = 1.5
JOB_TARGET = 0.8


def ndjson(texts: list[str]) -> bytes:
    import orjson

    return b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts)


async def start_job(url: str, body: bytes) -> tuple[str, float]:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{url}/v1/jobs", content=body,
                              params={"operation": "encode", "model": MINILM},
                              headers={"content-type": "application/x-ndjson"})
    r.raise_for_status()
    return r.json()["id"], time.perf_counter()


async def wait_job(url: str, job_id: str, started: float) -> float:
    """Seconds from its 202 until it reads succeeded."""
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            state = (await client.get(f"{url}/v1/jobs/{job_id}")).json()["state"]
            if state == "succeeded":
                return time.perf_counter() - started
            if state in ("failed", "cancelled"):
                raise RuntimeError(f"job {job_id} ended {state}")
            await asyncio.sleep(POLL_S)


async def callers(url: str, clients: int, duration: float) -> LoadResult:
    texts = make_texts(256)
    prepared = prepare(f"{url}/v1/encode/{MINILM}", [[t] for t in texts])
    return await run_load(f"{url}/v1/encode/{MINILM}", prepared, "closed", clients,
                          warmup=1.0, duration=duration)


async def one_round(url: str, args: argparse.Namespace, body: bytes) -> dict[str, float]:
    alone = await callers(url, args.clients, args.duration)
    job_id, started = await start_job(url, body)
    job_alone_s = await wait_job(url, job_id, started)
    job_id, started = await start_job(url, body)
    duration = min(args.duration, 0.8 * job_alone_s)  # the clients' window inside the job
    beside, job_beside_s = await asyncio.gather(callers(url, args.clients, duration),
                                                wait_job(url, job_id, started))
    return {"alone_p50": alone.p50_ms, "alone_p99": alone.p99_ms,
            "beside_p50": beside.p50_ms, "beside_p99": beside.p99_ms,
            "alone_rps": alone.req_per_s, "beside_rps": beside.req_per_s,
            "job_alone": args.texts / job_alone_s, "job_beside": args.texts / job_beside_s,
            "errors": alone.errors + beside.errors}


def report(rounds: list[dict[str, float]], args: argparse.Namespace) -> str:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    p99_ratio = statistics.median(r["beside_p99"] / r["alone_p99"] for r in rounds)
    job_ratio = statistics.median(r["job_beside"] / r["job_alone"] for r in rounds)
    lines = [
        f"{datetime.now(UTC).isoformat(timespec='seconds')}; MiniLM on this CPU; "
        f"{args.clients} closed-loop callers x 1 text; a job of {args.texts:,} texts; "
        f"median of {len(rounds)} round(s)",
        "",
        *table(["phase", "callers p50 ms", "callers p99 ms", "callers req/s", "job texts/s"], [
            ["callers alone", f"{med['alone_p50']:.1f}", f"{med['alone_p99']:.1f}",
             f"{med['alone_rps']:.1f}", "-"],
            ["job alone", "-", "-", "-", f"{med['job_alone']:,.0f}"],
            ["both", f"{med['beside_p50']:.1f}", f"{med['beside_p99']:.1f}",
             f"{med['beside_rps']:.1f}", f"{med['job_beside']:,.0f}"],
        ], align="lrrrr"),
        "",
        f"callers' p99 beside the job / alone: **{p99_ratio:.2f}** (target <= {P99_TARGET}); "
        f"the job's texts/s beside the callers / alone: **{job_ratio:.2f}** "
        f"(target >= {JOB_TARGET}); errors: {int(med['errors'])}",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bulk_interference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=20_000, help="texts in the bulk job")
    p.add_argument("--clients", type=int, default=2, help="closed-loop callers")
    p.add_argument("--duration", type=float, default=20.0, help="callers' window, seconds")
    p.add_argument("--rounds", type=int, default=1)
    add_env(p, "set in the stack's environment (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = env_of(args.env)
    body = ndjson(make_texts(args.texts, seed=1))
    print(f"`python -m bench.bulk_interference {' '.join(sys.argv[1:])}`", flush=True)
    with bench_stack(MINILM, env) as stack:
        rounds: list[dict[str, Any]] = []
        for i in range(args.rounds):
            rounds.append(asyncio.run(one_round(stack.url, args, body)))
            r = rounds[-1]
            print(f"  round {i + 1}: callers p99 {r['alone_p99']:.0f} -> {r['beside_p99']:.0f}"
                  f" ms; job {r['job_alone']:,.0f} -> {r['job_beside']:,.0f} texts/s",
                  flush=True)
    print(report(rounds, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
