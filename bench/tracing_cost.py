"""What tracing costs the stack: `bench.device_feed` with tracing off and on, alternating.

    .venv/bin/python -m bench.tracing_cost --rounds 3 -- --rounds 1 --duration 8 --warmup 2

Each round runs `bench.device_feed` (the real stack on an emulated device: every CPU step
of the path, the model's forward a wait) twice, tracing off and tracing on, their order
alternating from round to round so that a machine that grows busier favours neither.
Tracing on is every process exporting over OTLP/HTTP (`http/protobuf`) at 100% sampling
(`OTEL_TRACES_SAMPLER=always_on`) to a receiver this process runs (`tests.otlp_receiver`:
it parses each export and counts its spans, as a collector would take them; its CPU is
this process's, not the stack's). Arguments after `--` go to `bench.device_feed`.

The table: per load, the medians over the rounds of texts/s and of CPU µs per text of the
stack and of each process kind (from /proc, as `bench.device_feed` measures them), off and
on, on ÷ off; and the spans received per text while tracing was on (spans the SDK's batch
processors dropped under load would show as fewer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.tuning import markdown
from bench.lib.output import emit
from tests.otlp_receiver import OtlpReceiver

KINDS = ("total", "gateway", "worker", "runtime", "rabbitmq")


def traced_env(receiver: OtlpReceiver) -> list[str]:
    env = {**receiver.env(), "OTEL_TRACES_SAMPLER": "always_on",
           "OTEL_BSP_SCHEDULE_DELAY": "1000"}  # the SDK's default is 5 s: the window's spans
    return [f"{name}={value}" for name, value in env.items()]


def feed(argv: list[str], extra_env: list[str]) -> dict[str, Any]:
    """One `bench.device_feed` run's JSON."""
    with tempfile.TemporaryDirectory(prefix="shoal-tracing-cost-") as folder:
        out = Path(folder) / "out.json"
        env_args = [a for pair in extra_env for a in ("--env", pair)]
        done = subprocess.run([sys.executable, "-m", "bench.device_feed", *argv, *env_args,
                               "--json", str(out)], env=dict(os.environ), capture_output=True,
                              text=True, check=False)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"bench.device_feed failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def run(args: argparse.Namespace) -> dict[str, Any]:
    receiver = OtlpReceiver(keep=False).start()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    spans_per_text: list[list[float]] = []
    try:
        with tqdm(total=2 * args.rounds, desc="tracing off/on", file=sys.stderr) as bar:
            for i in range(args.rounds):
                for variant in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    before = receiver.span_count
                    data = feed(args.feed_args, traced_env(receiver) if variant == "on" else [])
                    runs[variant].append(data)
                    if variant == "on":
                        # Every span of the run (warm-ups too) over the measured windows'
                        # texts: an upper bound.
                        texts = sum(lo["texts_per_s"] * args.duration for lo in data["loads"])
                        spans_per_text.append([(receiver.span_count - before) / texts])
                    bar.update()
    finally:
        receiver.stop()
    loads = []
    for j, load in enumerate(runs["off"][0]["loads"]):
        row: dict[str, Any] = {"clients": load["clients"], "texts": load["texts"]}
        for variant, datas in runs.items():
            picked = [d["loads"][j] for d in datas]
            row[variant] = {"texts_per_s": statistics.median(p["texts_per_s"] for p in picked),
                            **{k: statistics.median(p["cpu_us_per_text"].get(k) or 0.0
                                                    for p in picked) for k in KINDS}}
        loads.append(row)
    return {"args": vars(args), "loads": loads, "runs": runs,
            "spans_per_text": statistics.median(s[0] for s in spans_per_text)
            if spans_per_text else None}


def table(result: dict[str, Any]) -> str:
    rows = []
    for load in result["loads"]:
        name = f"{load['clients']} x {load['texts']}"
        for key in ("texts_per_s", *KINDS):
            off, on = load["off"][key], load["on"][key]
            label = "texts/s" if key == "texts_per_s" else f"CPU µs/text, {key}"
            rows.append([name, label, f"{off:,.0f}", f"{on:,.0f}",
                         f"{on / off:.2f}" if off else "n/a"])
    spans = result["spans_per_text"]
    return "\n".join([
        *markdown.table(["load", "measure", "tracing off", "tracing on", "on ÷ off"], rows,
                        align="llrrr"),
        "", f"spans received while on, per text measured (warm-ups' spans included: an "
            f"upper bound): {spans:.2f}" if spans is not None else ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, feed_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0,
                        help="the measured seconds per load that device_feed is given")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(ours)
    if "--duration" in feed_args:
        args.duration = float(feed_args[feed_args.index("--duration") + 1])
    else:
        feed_args += ["--duration", str(args.duration)]
    args.feed_args = feed_args
    result = run(args)
    return emit(table(result), result, args.json)


if __name__ == "__main__":
    sys.exit(main())
