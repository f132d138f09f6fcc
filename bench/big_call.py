"""An indexing call as LangChain's `OpenAIEmbeddings` sends it by default: 1,000 chunks of
~900 characters in one POST /v1/embeddings, against a gateway + one worker serving the
packaged MiniLM on this machine's CPU (issue 52: it used to run 30 s and answer 504).

    .venv/bin/python -m bench.big_call [--chunks 1000] [--rounds 3]

Each round sends the call three ways and records status, wall time, the deadline the
request ran under and its parts (`X-Batch-Parts`): with no X-Timeout-Ms (the default
deadline scales with the predicted work: `gateway.calls.work_deadline`), with
`X-Timeout-Ms: 30000` (the old flat default, sent explicitly), and with
`X-Timeout-Ms: 5000` (too short for the whole: refused before it runs, in how long).
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from app.tuning.bench_stack import bench_stack
from bench.lib.minilm import MINILM

WAYS = {"no X-Timeout-Ms": None, "X-Timeout-Ms: 30000": "30000", "X-Timeout-Ms: 5000": "5000"}


def chunks(n: int) -> list[str]:
    return [f"Chunk {i}: " + "a paragraph of a long document. " * 28 for i in range(n)]


def one_call(url: str, texts: list[str], timeout_header: str | None) -> dict[str, object]:
    headers = {} if timeout_header is None else {"X-Timeout-Ms": timeout_header}
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/embeddings", json={"model": MINILM, "input": texts},
                   headers=headers, timeout=600)
    wall = time.perf_counter() - started
    body = r.json()
    answered = len(body.get("data", [])) if r.status_code == 200 else 0
    code = None if r.status_code == 200 else body.get("error", {}).get("code")
    return {"status": r.status_code, "code": code, "wall_s": wall, "answered": answered,
            "parts": r.headers.get("x-batch-parts")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    texts = chunks(args.chunks)
    results: dict[str, list[dict[str, object]]] = {way: [] for way in WAYS}
    with bench_stack(MINILM) as stack:
        for round_ in range(args.rounds):
            for way, header in WAYS.items():
                row = one_call(stack.url, texts, header)
                results[way].append(row)
                print(f"round {round_ + 1}/{args.rounds} {way}: {row}", flush=True)
    print(f"\n| request ({args.chunks} chunks of ~900 chars) | status (code) | answered "
          "| wall s, median (min-max) | parts |")
    print("|---|---|---|---|---|")
    for way, rows in results.items():
        walls = [float(r["wall_s"]) for r in rows]  # type: ignore[arg-type]
        statuses = sorted({f"{r['status']}" + (f" {r['code']}" if r["code"] else "")
                           for r in rows})
        print(f"| {way} | {', '.join(statuses)} | {rows[0]['answered']} | "
              f"{statistics.median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f}) | "
              f"{rows[0]['parts'] or '-'} |")


if __name__ == "__main__":
    main()
