"""The worker's runtime start with the packaged MiniLM pinned, on the default path (no
SHOAL_RUNTIME: its cpu profile chooses ONNX Runtime fp32) with an empty export cache
(the first start exports the graph), then again with the cache filled (every later
start), alternating with PyTorch (SHOAL_RUNTIME=pytorch) for reference.

    .venv/bin/python -m bench.default_start [--rounds 3] [--json out.json]

Each start is `app.worker.runtime.start_runtime` as the worker calls it: the runtime
process spawned, its engine imported, MiniLM loaded (on ONNX: its graph exported first
when SHOAL_ONNX_CACHE has none, in a child process with torch), until it is ready; then
one request of one text (the first answer). SHOAL_ONNX_CACHE is a fresh temporary folder,
so the first start always exports; the graph's mtime is checked after every later start
(an export there would be a regression: the cache must be reused).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from app.tuning.stats import median
from bench.lib.minilm import MINILM


def start_once(runtime_env: str | None) -> dict[str, float]:
    from app.worker.runtime import start_runtime
    from runtimes.base import Request
    from tasks.catalog import load_catalog
    from tasks.settings import Settings

    os.environ.pop("SHOAL_RUNTIME", None)
    if runtime_env is not None:
        os.environ["SHOAL_RUNTIME"] = runtime_env
    settings = Settings()
    entry = load_catalog(settings.catalog_dir).get(MINILM)
    started = time.perf_counter()
    runtime = start_runtime([entry], {MINILM}, settings, chunk_tokens=4096)
    ready = time.perf_counter()
    try:
        (outcome,) = runtime.run_batch(MINILM, [Request("1", "encode", {
            "model": MINILM, "items": [{"text": "The cat sits on the mat."}]})])
        assert outcome.ok, outcome.error_message
        answered = time.perf_counter()
    finally:
        runtime.close()
        os.environ.pop("SHOAL_RUNTIME", None)
    return {"ready_s": ready - started, "first_answer_s": answered - started}


def graphs(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*.onnx")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.default_start",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shoal-onnx-cache-") as cache:
        os.environ["SHOAL_ONNX_CACHE"] = cache
        first = start_once(None)
        exported = graphs(Path(cache))
        assert exported, "the default path exported no graph: ONNX did not serve MiniLM"
        runs.append({"case": "default, first start (export)", **first})
        print(runs[-1], file=sys.stderr)
        for r in range(args.rounds):
            order = [None, "pytorch"] if r % 2 == 0 else ["pytorch", None]
            for engine in order:
                case = "pytorch (SHOAL_RUNTIME=pytorch)" if engine else \
                    "default, later start (cached graph)"
                runs.append({"case": case, "round": r, **start_once(engine)})
                print(runs[-1], file=sys.stderr)
                assert graphs(Path(cache)) == exported, "the graph was exported again"
    cases = list(dict.fromkeys(run["case"] for run in runs))
    print("| start | runs | ready s (median) | first answer s (median) |")
    print("|---|---:|---:|---:|")
    for case in cases:
        mine = [run for run in runs if run["case"] == case]
        print(f"| {case} | {len(mine)} | {median([m['ready_s'] for m in mine]):.1f} | "
              f"{median([m['first_answer_s'] for m in mine]):.1f} |")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
