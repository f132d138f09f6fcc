"""One API key's many jobs beside another key's callers and job (issue 53's starvation probe).

    .venv/bin/python -m bench.key_fairness [--jobs 20] [--texts 512] [--clients 2]
        [--duration 15] [--window 60] [--rounds 1] [--env NAME=VALUE]

One stack (`app.tuning.bench_stack.bench_stack`: gateway + one worker serving the packaged
MiniLM on this CPU) with API keys on: key A and key B. Per round, three phases, each on
the idle stack (every job left is cancelled at a phase's end):

1. **B alone**: `--clients` closed-loop callers with B's key, one short text a request,
   for `--duration` s: p50/p99;
2. **B beside A's jobs**: A posts `--jobs` bulk jobs of `--texts` texts at once (all
   accepted or refused: the time it took and how many got 202), then B's callers run for
   `--duration` s: p50/p99, and the ratio of B's p99 to its quiet value (target <= 1.5);
3. **two keys' jobs**: A posts `--jobs` jobs, then B posts one of the same size; when
   B's job is done (or after `--window` s, if sooner), the texts done of each key's jobs
   (counted as whole parts are answered): each key's texts/s and B's share of the total
   (fair: about a half, whatever A's number of jobs; without a fair share B's one job
   gets about 1 / (jobs + 1)).

SHOAL_JOBS_PER_KEY is set to `--jobs` (override with --env) so that the limit does not
refuse A's jobs and the phases measure the fair share alone; SHOAL_JOB_PART_ITEMS to 64, so
that a job's progress (counted as whole parts are answered) moves within a minute on a
loaded CPU, where a default part of 512 texts takes several seconds
(`--env SHOAL_JOB_PART_ITEMS=0` for the default).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from app.tuning.bench_stack import bench_stack
from app.tuning.load import LoadResult, prepare, run_load
from app.tuning.markdown import table
from app.tuning.mix import make_texts
from bench.lib.args import add_env, env_of
from bench.lib.minilm import MINILM
from gateway.auth.key_file import hash_key, new_key

P99_TARGET = 1.5
POLL_S = 0.25


def ms(value: float | None) -> float:
    return math.inf if value is None else value


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ndjson(texts: list[str]) -> bytes:
    return b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts)


async def callers(url: str, key: str, clients: int, duration: float) -> LoadResult:
    endpoint = f"{url}/v1/encode/{MINILM}"
    header = f"\r\nAuthorization: Bearer {key}\r\nContent-Type:".encode()
    prepared = [replace(p, data=p.data.replace(b"\r\nContent-Type:", header, 1))
                for p in prepare(endpoint, [[t] for t in make_texts(256)])]
    return await run_load(endpoint, prepared, "closed", clients, warmup=1.0,
                          duration=duration)


async def post_jobs(client: httpx.AsyncClient, key: str, count: int, body: bytes
                    ) -> tuple[list[str], int, float]:
    """Post `count` jobs at once: (ids accepted, refused with 429, seconds for all)."""
    started = time.perf_counter()
    answers = await asyncio.gather(*(client.post(
        "/v1/jobs", content=body, params={"operation": "encode", "model": MINILM},
        headers={"content-type": "application/x-ndjson", **auth(key)}) for _ in range(count)))
    took = time.perf_counter() - started
    for r in answers:
        if r.status_code not in (202, 429):
            raise RuntimeError(f"a job was answered {r.status_code}: {r.text[:300]}")
    return [r.json()["id"] for r in answers if r.status_code == 202], \
        sum(r.status_code == 429 for r in answers), took


async def done(client: httpx.AsyncClient, key: str, ids: list[str]) -> int:
    views = await asyncio.gather(*(client.get(f"/v1/jobs/{i}", headers=auth(key))
                                   for i in ids))
    return sum(v.json()["progress"]["items_done"] for v in views)


async def cancel_all(client: httpx.AsyncClient, jobs: dict[str, list[str]]) -> None:
    for key, ids in jobs.items():
        await asyncio.gather(*(client.delete(f"/v1/jobs/{i}", headers=auth(key)) for i in ids))
    for key, ids in jobs.items():  # until the worker has answered or dropped what was out
        for job_id in ids:
            while (await client.get(f"/v1/jobs/{job_id}", headers=auth(key))).json()[
                    "state"] in ("queued", "running"):
                await asyncio.sleep(POLL_S)
    await asyncio.sleep(2.0)  # parts revoked but still held drain from the worker


async def one_round(url: str, a: str, b: str, args: argparse.Namespace, body: bytes
                    ) -> dict[str, float]:
    out: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        alone = await callers(url, b, args.clients, args.duration)
        ids, refused, took = await post_jobs(client, a, args.jobs, body)
        beside = await callers(url, b, args.clients, args.duration)
        await cancel_all(client, {a: ids})
        # No answer inside the window at all: infinitely slow (its errors say why).
        out.update(alone_p50=ms(alone.p50_ms), alone_p99=ms(alone.p99_ms),
                   beside_p50=ms(beside.p50_ms), beside_p99=ms(beside.p99_ms),
                   beside_answers=beside.requests, accepted=len(ids), refused=refused,
                   accept_s=took, errors=alone.errors + beside.errors)
        ids, _, _ = await post_jobs(client, a, args.jobs, body)
        (b_id,), _, _ = await post_jobs(client, b, 1, body)
        started = time.perf_counter()
        while True:  # until B's job is done, or the window ends
            a_done, b_done = await asyncio.gather(done(client, a, ids),
                                                  done(client, b, [b_id]))
            window = time.perf_counter() - started
            if b_done >= args.texts or window >= args.window:
                break
            await asyncio.sleep(POLL_S)
        await cancel_all(client, {a: ids, b: [b_id]})
        out.update(a_rate=a_done / window, b_rate=b_done / window, phase3_s=window,
                   b_share=b_done / max(1, a_done + b_done))
    return out


def report(rounds: list[dict[str, float]], args: argparse.Namespace) -> str:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratio = statistics.median(r["beside_p99"] / r["alone_p99"] for r in rounds)
    return "\n".join([
        f"{datetime.now(UTC).isoformat(timespec='seconds')}; MiniLM on this CPU; key A: "
        f"{args.jobs} bulk jobs of {args.texts:,} texts posted at once (parts of "
        f"{args.part_items} texts); key B: "
        f"{args.clients} closed-loop callers x 1 text for {args.duration:g} s, or one job of "
        f"{args.texts:,} texts; median of {len(rounds)} round(s)",
        "",
        *table(["phase", "B p50 ms", "B p99 ms", "B answers in the window", "B errors"], [
            ["B's callers alone", f"{med['alone_p50']:.1f}", f"{med['alone_p99']:.1f}", "-",
             "-"],
            [f"B's callers beside A's {int(med['accepted'])} jobs",
             f"{med['beside_p50']:.1f}", f"{med['beside_p99']:.1f}",
             f"{med['beside_answers']:g}", f"{med['errors']:g}"],
        ], align="lrrrr"),
        "",
        *table([f"two keys' jobs, until B's is done (at most {args.window:g} s; median "
                f"{med['phase3_s']:.0f} s)", "texts/s"], [
            [f"key A ({args.jobs} jobs)", f"{med['a_rate']:,.0f}"],
            ["key B (1 job)", f"{med['b_rate']:,.0f}"],
            ["B's share of the texts done", f"{med['b_share']:.2f}"],
        ], align="lr"),
        "",
        f"A's {args.jobs} jobs: {med['accepted']:g} accepted, {med['refused']:g} refused (429) "
        f"in {med['accept_s']:.2f} s. B's p99 beside A's jobs / alone: **{ratio:.2f}** "
        f"(target <= {P99_TARGET}); B's share of the two keys' texts: "
        f"**{med['b_share']:.2f}** (fair: 0.5)",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.key_fairness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20, help="key A's jobs, posted at once")
    p.add_argument("--texts", type=int, default=512, help="texts in each job")
    p.add_argument("--clients", type=int, default=2, help="key B's closed-loop callers")
    p.add_argument("--duration", type=float, default=15.0, help="callers' window, seconds")
    p.add_argument("--window", type=float, default=60.0,
                   help="the most seconds the two keys' jobs run before their progress "
                   "is read (it is read when B's job is done, if sooner)")
    p.add_argument("--rounds", type=int, default=1)
    add_env(p, "set in the stack's environment (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    a, b = new_key(), new_key()
    args.part_items = env_of(args.env).get("SHOAL_JOB_PART_ITEMS", "64")
    keys_file = Path(tempfile.mkdtemp(prefix="shoal-keys-")) / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [{"name": "A", "hash": hash_key(a)},
                                                  {"name": "B", "hash": hash_key(b)}]}))
    env = {"SHOAL_API_KEYS_FILE": str(keys_file), "SHOAL_JOBS_PER_KEY": str(args.jobs),
           "SHOAL_JOB_PART_ITEMS": "64", **env_of(args.env)}
    body = ndjson(make_texts(args.texts, seed=1))
    print(f"`python -m bench.key_fairness {' '.join(sys.argv[1:])}`", flush=True)
    with bench_stack(MINILM, env, probe_headers=auth(a)) as stack:
        rounds: list[dict[str, Any]] = []
        for i in range(args.rounds):
            rounds.append(asyncio.run(one_round(stack.url, a, b, args, body)))
            r = rounds[-1]
            print(f"  round {i + 1}: B p99 {r['alone_p99']:.0f} -> {r['beside_p99']:.0f} ms; "
                  f"texts/s A {r['a_rate']:,.0f}, B {r['b_rate']:,.0f}", file=sys.stderr,
                  flush=True)
    print(report(rounds, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
