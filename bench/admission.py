"""Admission after a cold start: would a servable text be refused on a guess?

    .venv/bin/python -m bench.admission [--starts 3000] [--seed 0] [--json out.json]

Each start is a fresh cost model seeded with all-MiniLM-L6-v2's cpu profile (~10 ms
a batch) that measures 5-12 tiny batches (tokens x longest <= 36) taking 40-200 ms
each: the first batches of a worker on a loaded host, or beside a spare runtime
importing torch. It then predicts one 256-token text (~36 ms by the profile).

Per start: what the least-squares fit alone extrapolates (what admission relied on
before issue 41: 192 of 3,000 over 30 s with the code of 3bdb21f), what
`CostModel.predict` says (capped beyond the measured shapes) and what a refusal may
rely on (`CostModel.admission`). Counted: the starts where each exceeds the default
30 s deadline, i.e. where the text would have been refused.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from tqdm import tqdm

from app.tuning import markdown
from batching.latency_model import BatchShape, CostModel
from bench.lib.output import emit

SEED = (0.010136, 103.138e-6, 0.0)  # models/all-minilm-l6-v2.yaml, profile cpu
TEXT = BatchShape(1, 256, 256)
DEADLINE_S = 30.0


def cold_start(rng: random.Random) -> CostModel:
    model = CostModel(*SEED)
    for _ in range(rng.randint(5, 12)):
        longest = rng.randint(1, 6)
        items = rng.randint(1, 36 // longest**2)
        model.observe(BatchShape(items, longest, items * longest), rng.uniform(0.040, 0.200))
    return model


def fitted(model: CostModel, shape: BatchShape) -> float:
    a, b, c = model.coefficients
    tokens = shape.items * shape.longest
    return a + tokens * (b + c * shape.longest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    figures: dict[str, list[float]] = {
        "least-squares fit alone": [], "predict": [], "admission": []}
    for _ in tqdm(range(args.starts), desc="cold starts", unit="start"):
        model = cold_start(rng)
        figures["least-squares fit alone"].append(fitted(model, TEXT))
        figures["predict"].append(model.predict(TEXT))
        figures["admission"].append(model.admission(TEXT).seconds)
    rows = []
    for name, seconds in figures.items():
        seconds.sort()
        refused = sum(s > DEADLINE_S for s in seconds)
        rows.append([name, f"{refused} ({100 * refused / len(seconds):.1f}%)",
                     f"{statistics.median(seconds) * 1000:.0f}",
                     f"{seconds[int(0.9 * len(seconds))] * 1000:.0f}",
                     f"{seconds[-1] * 1000:.0f}"])
    table = markdown.table(
        ["256-token text predicted by", f"> {DEADLINE_S:.0f} s (refused) of {args.starts}",
         "median ms", "p90 ms", "worst ms"], rows, align="lrrrr")
    return emit("\n".join(table), {"starts": args.starts, "seed": args.seed, "figures": figures},
                args.json)


if __name__ == "__main__":
    raise SystemExit(main())
