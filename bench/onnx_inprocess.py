"""MiniLM in process on the CPU: PyTorch against ONNX Runtime fp32 and int8 (issue 27).

    .venv/bin/python -m bench.onnx_inprocess [--batches 1,8,32,128] [--rounds 3]
        [--texts 256] [--threads 2] [--json bench/out/onnx-inprocess.json]
        [--png docs/bench/onnx-inprocess.png]

The packaged sentence-transformers/all-MiniLM-L6-v2 is loaded three times in this
process through `runtimes.child_side.host.ModelHost` (the worker's path: tokenise, forward, pool,
normalise, float32 bytes out): engine pytorch, engine onnx at fp32, engine onnx at
int8, all with the same intra-op threads. A missing ONNX graph is exported first
(`shoal export`, a child process), before anything is timed.

Throughput: the same `app.tuning.mix.make_texts` texts, cut into batches of N texts
(one encode request of N items per batch), one warm-up pass per engine and size, then
one timed pass per round. Each round measures every size on the three engines, in an
order rotated round by round (each engine first, second and third as often), so noise
on a shared machine hits all three. Reported: the median over rounds of texts/s, and
each engine's ratio to PyTorch at the same size and to PyTorch's best size.

Quality (int8 and PyTorch against ORT fp32), on 1,000 other texts: the cosine of each
text's two vectors (mean, min); and a retrieval set built from them: 100 queries, each
a shortened, shuffled copy of one text (about half its words), searched over the
1,000 texts by cosine. Overlap@10: the share of fp32's top 10 that int8's top 10
holds; recall@10: the share of queries whose source text is in the top 10.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.tuning import markdown
from app.tuning.markdown import dash
from app.tuning.stats import median, ratio
from bench.lib.args import parse_levels
from bench.lib.minilm import MINILM
from bench.lib.output import emit

# name -> (ModelHost engine, precision)
ENGINES = {"pytorch": ("pytorch", None), "ort-fp32": ("onnx", "fp32"),
           "ort-int8": ("onnx", "int8")}
LABELS = {"pytorch": "PyTorch", "ort-fp32": "ORT fp32", "ort-int8": "ORT int8"}
TARGETS = {"ort-fp32": 1.5, "ort-int8": 2.5}  # x PyTorch's best batch throughput
QUALITY = {"min_overlap_at_10": 0.98, "max_recall_drop": 0.02}


# --------------------------------------------------------------------------- pure logic


def order(rnd: int, engines: Sequence[str] = tuple(ENGINES)) -> list[str]:
    """The engines of round `rnd`, rotated by one each round."""
    k = rnd % len(engines)
    return [*engines[k:], *engines[:k]]


def batches(texts: list[str], size: int) -> list[list[str]]:
    """`texts` cut into full batches of `size` (the last wraps around to the start)."""
    count = -(-len(texts) // size)
    return [[texts[(b * size + j) % len(texts)] for j in range(size)] for b in range(count)]


def shorten(text: str, rng: random.Random) -> str:
    """A query made from `text`: about half its words (at least two), order shuffled."""
    words = text.rstrip(".").split()
    keep = rng.sample(words, max(2, len(words) // 2))
    return " ".join(keep).lower()


def top_k(queries: np.ndarray, corpus: np.ndarray, k: int = 10) -> np.ndarray:
    """Indices of the `k` corpus rows of highest cosine for each query, best first."""
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    c = corpus / np.linalg.norm(corpus, axis=1, keepdims=True)
    scores = q @ c.T
    best = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    rows = np.arange(len(q))[:, None]
    return best[rows, np.argsort(-scores[rows, best], axis=1)]


def overlap_at_k(a: np.ndarray, b: np.ndarray) -> float:
    """Mean share of each row of `a` (top-k indices) that the same row of `b` holds."""
    return float(np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a, b, strict=True)]))


def recall_at_k(found: np.ndarray, wanted: Sequence[int]) -> float:
    """Share of queries whose wanted index is among their top-k."""
    return float(np.mean([w in row for row, w in zip(found, wanted, strict=True)]))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def summarise(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median texts/s per engine and size; ratios to PyTorch at the size and at its best."""
    sizes = sorted({run["batch"] for run in runs})
    engines = [e for e in ENGINES if any(run["engine"] == e for run in runs)]
    rates = {e: {s: median([r["texts_per_s"] for r in runs
                            if r["engine"] == e and r["batch"] == s]) for s in sizes}
             for e in engines}
    torch_rates = [v for v in rates.get("pytorch", {}).values() if v is not None]
    torch_best = max(torch_rates) if torch_rates else None
    rows = []
    for s in sizes:
        row: dict[str, Any] = {"batch": s}
        for e in engines:
            row[f"{e}_texts_per_s"] = rates[e][s]
            row[f"{e}_vs_pytorch"] = ratio(rates[e][s], rates.get("pytorch", {}).get(s))
            row[f"{e}_vs_pytorch_best"] = ratio(rates[e][s], torch_best)
        rows.append(row)
    best = {e: max((v for v in rates[e].values() if v is not None), default=None)
            for e in engines}
    return {"rows": rows, "pytorch_best": torch_best, "best": best,
            "best_vs_pytorch_best": {e: ratio(best[e], torch_best) for e in engines}}


def table(summary: Mapping[str, Any]) -> str:
    engines = [e for e in ENGINES if e in summary["best"]]
    header = ["texts/batch", *(f"{LABELS[e]} texts/s" for e in engines),
              *(f"{LABELS[e]} / PyTorch same batch" for e in engines if e != "pytorch"),
              *(f"{LABELS[e]} / PyTorch best" for e in engines)]
    rows = []
    for row in summary["rows"]:
        rows.append([row["batch"], *(dash(row[f"{e}_texts_per_s"], ".0f") for e in engines),
                     *(dash(row[f"{e}_vs_pytorch"], ".2f") for e in engines if e != "pytorch"),
                     *(dash(row[f"{e}_vs_pytorch_best"], ".2f") for e in engines)])
    return "\n".join(markdown.table(header, rows))


def verdicts(summary: Mapping[str, Any], quality: Mapping[str, Any] | None) -> list[str]:
    """One line per target: met or not, with the number."""
    lines = []
    for e, target in TARGETS.items():
        got = summary["best_vs_pytorch_best"].get(e)
        if got is not None:
            lines.append(f"{LABELS[e]} best / PyTorch best = {got:.2f}x (target >= {target}x): "
                         + ("met" if got >= target else "NOT met"))
    if quality:
        ov = quality["int8_overlap_at_10"]
        drop = quality["fp32_recall_at_10"] - quality["int8_recall_at_10"]
        lines.append(f"int8 overlap@10 with fp32 = {ov:.3f} (target >= "
                     f"{QUALITY['min_overlap_at_10']}): "
                     + ("met" if ov >= QUALITY["min_overlap_at_10"] else "NOT met"))
        lines.append(f"recall@10 fp32 {quality['fp32_recall_at_10']:.3f}, int8 "
                     f"{quality['int8_recall_at_10']:.3f} (drop {drop:+.3f}, target <= "
                     f"{QUALITY['max_recall_drop']}): "
                     + ("met" if drop <= QUALITY["max_recall_drop"] + 1e-9 else "NOT met"))
    return lines


# --------------------------------------------------------------------------- measuring


def _encode(host: Any, model_id: str, texts: list[str]) -> np.ndarray:
    from runtimes.base import Request

    request = Request(id="bench", op="encode", kwargs={"items": [{"text": t} for t in texts]})
    (outcome,) = host.run_batch(model_id, [request])
    result = outcome.result
    if not isinstance(result, dict) or "embeddings" not in result:
        raise RuntimeError(f"encode failed: {outcome}")
    return np.frombuffer(result["embeddings"], dtype="<f4").reshape(result["count"],
                                                                    result["dims"])


def _timed_pass(host: Any, model_id: str, cut: list[list[str]]) -> float:
    started = time.perf_counter()
    for batch in cut:
        _encode(host, model_id, batch)
    return sum(len(b) for b in cut) / (time.perf_counter() - started)


def load_hosts(threads: int) -> tuple[str, dict[str, Any]]:
    from runtimes.child_side.host import ModelHost
    from tasks.catalog import load_catalog
    from tasks.settings import get_settings

    entry = load_catalog(get_settings().catalog_dir).get(MINILM)
    hosts = {}
    for name, (engine, precision) in ENGINES.items():
        print(f"  loading {LABELS[name]}", file=sys.stderr)
        host = ModelHost(engine=engine, precision=precision, threads=threads)
        host.load_one(entry)  # exports a missing ONNX graph first (child process)
        hosts[name] = host
    return entry.id, hosts


def quality(model_id: str, hosts: Mapping[str, Any], count: int = 1000,
            queries: int = 100, seed: int = 27) -> dict[str, Any]:
    from app.tuning.mix import make_texts

    texts = make_texts(count, seed=seed)
    rng = random.Random(seed)
    sources = rng.sample(range(count), queries)
    asked = [shorten(texts[i], rng) for i in sources]
    vecs = {name: np.concatenate([_encode(host, model_id, texts[i:i + 64])
                                  for i in range(0, count, 64)])
            for name, host in hosts.items()}
    qvecs = {name: _encode(host, model_id, asked) for name, host in hosts.items()}
    tops = {name: top_k(qvecs[name], vecs[name]) for name in hosts}
    out: dict[str, Any] = {"texts": count, "queries": queries,
                           "example_query": [texts[sources[0]], asked[0]]}
    for name in hosts:
        out[f"{name}_recall_at_10"] = recall_at_k(tops[name], sources)
        if name == "ort-fp32":
            continue
        cos = cosines(vecs[name], vecs["ort-fp32"])
        out[f"{name}_cosine_mean"] = float(cos.mean())
        out[f"{name}_cosine_min"] = float(cos.min())
        out[f"{name}_overlap_at_10"] = overlap_at_k(tops["ort-fp32"], tops[name])
    out["fp32_recall_at_10"] = out["ort-fp32_recall_at_10"]
    out["int8_recall_at_10"] = out["ort-int8_recall_at_10"]
    out["int8_overlap_at_10"] = out["ort-int8_overlap_at_10"]
    return out


def quality_table(q: Mapping[str, Any]) -> str:
    rows = []
    for name in ("ort-int8", "pytorch"):
        rows.append([f"{LABELS[name]} vs ORT fp32", f"{q[f'{name}_cosine_mean']:.5f}",
                     f"{q[f'{name}_cosine_min']:.5f}", f"{q[f'{name}_overlap_at_10']:.3f}",
                     f"{q[f'{name}_recall_at_10']:.3f}", f"{q['ort-fp32_recall_at_10']:.3f}"])
    return "\n".join(markdown.table(
        ["engine", "cosine mean", "cosine min", "overlap@10 with fp32", "recall@10",
         "recall@10 fp32"], rows, align="lrrrrr"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from app.tuning.inproc import machine_info
    from app.tuning.mix import make_texts

    model_id, hosts = load_hosts(args.threads)
    texts = make_texts(args.texts)
    cuts = {size: batches(texts, size) for size in args.batches}
    for host in hosts.values():  # warm-up: one pass per engine and size
        for size in args.batches:
            _timed_pass(host, model_id, cuts[size])
    runs = []
    plan = [(r, size, name) for r in range(args.rounds) for size in args.batches
            for name in order(r)]
    with tqdm(total=len(plan), unit="pass", file=sys.stderr) as bar:
        for r, size, name in plan:
            bar.set_description(f"round {r + 1}: {LABELS[name]}, batch {size}")
            rate = _timed_pass(hosts[name], model_id, cuts[size])
            runs.append({"round": r, "batch": size, "engine": name, "texts_per_s": rate})
            bar.update()
    if not args.no_quality:
        print("  quality on 1,000 texts", file=sys.stderr)
    q = quality(model_id, hosts) if not args.no_quality else None
    return {"machine": machine_info(), "threads": args.threads, "texts": args.texts,
            "rounds": args.rounds, "batches": args.batches, "runs": runs,
            "summary": summarise(runs), "quality": q}


def plot(path: Path, data: Mapping[str, Any]) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = data["summary"]
    sizes = [row["batch"] for row in summary["rows"]]
    fig = Figure(figsize=(9, 4), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    x = list(range(len(sizes)))
    colors = {"pytorch": "tab:orange", "ort-fp32": "tab:blue", "ort-int8": "tab:green"}
    engines = [e for e in ENGINES if e in summary["best"]]
    width = 0.8 / len(engines)
    for i, e in enumerate(engines):
        offset = (i - (len(engines) - 1) / 2) * width
        left.bar([j + offset for j in x], [row[f"{e}_texts_per_s"] or 0
                                           for row in summary["rows"]],
                 width=width, color=colors[e], label=LABELS[e])
        right.bar([j + offset for j in x], [row[f"{e}_vs_pytorch_best"] or 0
                                            for row in summary["rows"]],
                  width=width, color=colors[e], label=LABELS[e])
    for target, e in ((1.5, "ort-fp32"), (2.5, "ort-int8")):
        right.axhline(target, color=colors[e], linestyle=":", linewidth=1)
    right.axhline(1.0, color="grey", linewidth=0.8)
    for axis, title in ((left, "texts/s (higher is better)"),
                        (right, "x PyTorch's best batch (dotted: targets)")):
        axis.set_xticks(x, [str(s) for s in sizes])
        axis.set_xlabel("texts per batch")
        axis.set_title(title)
        axis.legend()
    q = data.get("quality")
    extra = (f"; int8 vs fp32: cosine mean {q['ort-int8_cosine_mean']:.4f}, "
             f"overlap@10 {q['int8_overlap_at_10']:.2f}") if q else ""
    fig.suptitle(f"MiniLM-L6 in process, {data['threads']} threads on "
                 f"{data['machine'].get('nproc')} CPU cores, median of {data['rounds']} "
                 f"rounds{extra}", fontsize=10)
    fig.savefig(path, dpi=100)
    return path


def report(data: Mapping[str, Any]) -> str:
    lines = [f"`python -m bench.onnx_inprocess --batches {','.join(map(str, data['batches']))} "
             f"--rounds {data['rounds']} --texts {data['texts']} --threads {data['threads']}` "
             f"({data['machine'].get('cpu_model')}, {data['machine'].get('nproc')} cores; "
             "median texts/s over rounds)", "", table(data["summary"]), ""]
    if data.get("quality"):
        lines += [quality_table(data["quality"]), ""]
    lines += [f"- {line}" for line in verdicts(data["summary"], data.get("quality"))]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.onnx_inprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=parse_levels, default=[1, 8, 32, 128],
                        help="texts per batch, comma-separated (default 1,8,32,128)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts", type=int, default=256, help="texts per timed pass")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads, every engine")
    parser.add_argument("--no-quality", action="store_true", help="skip the quality check")
    parser.add_argument("--json", type=Path, help="write runs, summary and quality here")
    parser.add_argument("--png", type=Path, help="plot here (docs/bench/onnx-inprocess.png)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.texts < 1 or args.threads < 1:
        parser.error("--rounds, --texts and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = run(args)
    if args.png:
        plot(args.png, data)
    return emit(report(data), data, args.json)


if __name__ == "__main__":
    sys.exit(main())
