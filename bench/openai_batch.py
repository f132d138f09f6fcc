"""OpenAI's Batch API under load: an N-line embeddings batch beside sync callers (issue 52).

    .venv/bin/python -m bench.openai_batch [--lines 100000] [--clients 2] [--duration 20]
        [--url http://127.0.0.1:8080] [--env NAME=VALUE]

Against a running gateway (`--url`, serving the packaged MiniLM), or a stack of its own
(`app.tuning.bench_stack.bench_stack`: gateway + one worker on this CPU). Three phases:

1. **callers alone**: `--clients` closed-loop callers of `POST /v1/embeddings`, one short
   text a request, for `--duration` s: p50/p99;
2. **the batch**: a JSONL file of `--lines` `/v1/embeddings` lines (one text each) uploaded
   (`POST /v1/files`, multipart, as the openai SDK sends it), `POST /v1/batches`, then
   `GET /v1/batches/{id}` until `completed` (its `request_counts` drive a progress bar);
3. **callers beside it**: the same callers, started with the batch, for `--duration` s (the
   table says whether the batch was still running when their window ended).

Then the output and error files are downloaded and checked: every custom_id answered
exactly once. Reported: upload and acceptance (validation) time, the batch's lines/s
and completion time, and the callers' p50/p99 without and with the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson

from app.tuning.bench_stack import bench_stack
from app.tuning.load import LoadResult, prepare, run_load
from app.tuning.markdown import table
from app.tuning.mix import make_texts
from bench.lib.args import add_env, env_of
from bench.lib.minilm import MINILM

POLL_S = 0.5


def batch_file(texts: list[str]) -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"line-{i}", "method": "POST",
                                  "url": "/v1/embeddings",
                                  "body": {"model": MINILM, "input": text}}) + b"\n"
                    for i, text in enumerate(texts))


async def callers(url: str, clients: int, duration: float) -> LoadResult:
    texts = make_texts(256)
    prepared = prepare(f"{url}/v1/embeddings", [[t] for t in texts],
                       body=lambda batch: {"model": MINILM, "input": batch[0]})
    return await run_load(f"{url}/v1/embeddings", prepared, "closed", clients,
                          warmup=1.0, duration=duration)


async def submit(client: httpx.AsyncClient, data: bytes) -> tuple[str, float, float, float]:
    """(batch id, upload s, acceptance s, the moment it was accepted)."""
    started = time.perf_counter()
    r = await client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("bench.jsonl", data, "application/jsonl")})
    r.raise_for_status()
    uploaded = time.perf_counter()
    r = await client.post("/v1/batches", json={"input_file_id": r.json()["id"],
                                               "endpoint": "/v1/embeddings",
                                               "completion_window": "24h"})
    r.raise_for_status()
    accepted = time.perf_counter()
    return r.json()["id"], uploaded - started, accepted - uploaded, accepted


async def wait_batch(client: httpx.AsyncClient, batch_id: str, lines: int) -> dict[str, Any]:
    from tqdm import tqdm

    with tqdm(total=lines, unit="line", desc="batch", file=sys.stderr, smoothing=0.1) as bar:
        while True:
            batch = (await client.get(f"/v1/batches/{batch_id}")).json()
            counts = batch["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            bar.set_postfix_str(batch["status"], refresh=False)
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                return batch
            await asyncio.sleep(POLL_S)


async def answered(client: httpx.AsyncClient, batch: dict[str, Any], lines: int
                   ) -> tuple[bool, int, int]:
    """(every line answered exactly once, output lines, error lines)."""
    seen: Counter[str] = Counter()
    found = []
    for key in ("output_file_id", "error_file_id"):
        count = 0
        if batch[key]:
            r = await client.get(f"/v1/files/{batch[key]}/content")
            r.raise_for_status()
            for line in r.content.splitlines():
                seen[orjson.loads(line)["custom_id"]] += 1
                count += 1
        found.append(count)
    once = set(seen) == {f"line-{i}" for i in range(lines)} and set(seen.values()) == {1}
    return once, found[0], found[1]


async def run(url: str, args: argparse.Namespace, data: bytes) -> dict[str, Any]:
    alone = await callers(url, args.clients, args.duration)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        batch_id, upload_s, accept_s, accepted = await submit(client, data)
        waiting = asyncio.ensure_future(wait_batch(client, batch_id, args.lines))
        beside = await callers(url, args.clients, args.duration)
        inside = not waiting.done()
        batch = await waiting
        done_s = time.perf_counter() - accepted
        once, output, errors = await answered(client, batch, args.lines)
    return {"alone": alone, "beside": beside, "inside": inside, "batch": batch,
            "upload_s": upload_s, "accept_s": accept_s, "done_s": done_s, "once": once,
            "output": output, "errors": errors}


def report(r: dict[str, Any], args: argparse.Namespace) -> str:
    alone, beside, batch = r["alone"], r["beside"], r["batch"]
    counts = batch["request_counts"]
    return "\n".join([
        f"{datetime.now(UTC).isoformat(timespec='seconds')}; MiniLM on this CPU; a batch of "
        f"{args.lines:,} /v1/embeddings lines (one text each); {args.clients} closed-loop "
        f"sync callers x 1 text, {args.duration:g} s windows",
        "",
        *table(["phase", "callers p50 ms", "callers p99 ms", "callers req/s", "errors"], [
            ["callers alone", f"{alone.p50_ms:.1f}", f"{alone.p99_ms:.1f}",
             f"{alone.req_per_s:.1f}", str(alone.errors)],
            ["callers beside the batch", f"{beside.p50_ms:.1f}", f"{beside.p99_ms:.1f}",
             f"{beside.req_per_s:.1f}", str(beside.errors)],
        ], align="lrrrr"),
        "",
        *table(["batch", "value"], [
            ["status", batch["status"]],
            ["upload (POST /v1/files)", f"{r['upload_s']:.2f} s"],
            ["acceptance (POST /v1/batches: every line checked)", f"{r['accept_s']:.2f} s"],
            ["completion (accepted -> completed)", f"{r['done_s']:.1f} s"],
            ["lines/s (accepted -> completed)", f"{args.lines / r['done_s']:,.0f}"],
            ["request_counts", f"{counts['completed']:,} completed, {counts['failed']:,} "
                               f"failed of {counts['total']:,}"],
            ["output / error file lines", f"{r['output']:,} / {r['errors']:,}"],
            ["every line answered exactly once", "yes" if r["once"] else "**NO**"],
            ["callers' window inside the batch", "yes" if r["inside"] else
             "no (the batch ended first: use more --lines)"],
        ], align="lr"),
        "",
        f"callers' p99 beside the batch / alone: **{beside.p99_ms / alone.p99_ms:.2f}**",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.openai_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=100_000, help="lines in the batch")
    p.add_argument("--clients", type=int, default=2, help="closed-loop sync callers")
    p.add_argument("--duration", type=float, default=20.0, help="callers' window, seconds")
    p.add_argument("--url", help="a running gateway (default: start a stack of its own)")
    add_env(p, "set in the stack's environment (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = batch_file(make_texts(args.lines, seed=1))
    print(f"`python -m bench.openai_batch {' '.join(sys.argv[1:])}`", flush=True)
    with (contextlib.nullcontext(None) if args.url else
          bench_stack(MINILM, env_of(args.env))) as stack:
        result = asyncio.run(run(args.url or stack.url, args, data))
    print(report(result, args))
    return 0 if result["once"] and result["batch"]["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
