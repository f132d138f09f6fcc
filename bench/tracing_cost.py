"""What tracing costs the stack: `bench.device_feed` with tracing off and on, alternating.

    .venv/bin/python -m bench.tracing_cost --rounds 3 [--ratio 0.1] \
        -- --rounds 1 --duration 8 --warmup 2

Each round runs `bench.device_feed` (the real stack on an emulated device: every CPU step
of the path, the model's forward a wait) with tracing off and tracing on (and, with
`--ratio R`, on for a share R of the requests), their order alternating from round to
round so that a machine that grows busier favours none.
Tracing on is every process exporting over OTLP/HTTP (`http/protobuf`) at 100% sampling
(`OTEL_TRACES_SAMPLER=always_on`) to a receiver this process runs (`tests.otlp_receiver`:
it parses each export and counts its spans, as a collector would take them; its CPU is
this process's, not the stack's). Arguments after `--` go to `bench.device_feed`.

The table: per load, the medians over the rounds of texts/s and of CPU µs per text of the
stack and of each process kind (from /proc, as `bench.device_feed` measures them), off and
on, on ÷ off; and the spans received per request while tracing was on (spans the SDK's
batch processors dropped under load would show as fewer).
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


def traced_env(receiver: OtlpReceiver, ratio: float | None = None) -> list[str]:
    """Tracing on: every request (`always_on`), or a `ratio` of them."""
    sampler = {"OTEL_TRACES_SAMPLER": "always_on"} if ratio is None else {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(ratio)}
    env = {**receiver.env(), **sampler,
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
    envs = {"off": [], "on": traced_env(receiver)}
    if args.ratio is not None:
        envs[f"on, {args.ratio:g} sampled"] = traced_env(receiver, args.ratio)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in envs}
    spans_per_request: dict[str, list[float]] = {name: [] for name in envs}
    try:
        with tqdm(total=len(envs) * args.rounds, desc="tracing off/on",
                  file=sys.stderr) as bar:
            for i in range(args.rounds):
                order = list(envs) if i % 2 == 0 else list(reversed(envs))
                for variant in order:
                    before = receiver.span_count
                    data = feed(args.feed_args, envs[variant])
                    runs[variant].append(data)
                    # Every span of the run (warm-ups too) over the measured windows'
                    # requests: an upper bound.
                    requests = sum(lo["texts_per_s"] * args.duration / lo["texts"]
                                   for lo in data["loads"])
                    spans_per_request[variant].append((receiver.span_count - before) / requests)
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
            "spans_per_request": {k: statistics.median(v) for k, v in spans_per_request.items()}}


def table(result: dict[str, Any]) -> str:
    variants = [v for v in result["loads"][0] if v not in ("clients", "texts")]
    rows = []
    for load in result["loads"]:
        name = f"{load['clients']} x {load['texts']}"
        for key in ("texts_per_s", *KINDS):
            off = load["off"][key]
            label = "texts/s" if key == "texts_per_s" else f"CPU µs/text, {key}"
            cells = []
            for variant in variants[1:]:
                on = load[variant][key]
                cells += [f"{on:,.0f}", f"{on / off:.2f}" if off else "n/a"]
            rows.append([name, label, f"{off:,.0f}", *cells])
    spans = ", ".join(f"{v} {n:.1f}" for v, n in result["spans_per_request"].items())
    header = ["load", "measure", "tracing off"]
    for variant in variants[1:]:
        header += [f"tracing {variant}", "÷ off"]
    return "\n".join([
        *markdown.table(header, rows, align="ll" + "r" * (len(header) - 2)), "",
        f"spans received per request measured (warm-ups' spans included: an upper bound): "
        f"{spans}"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, feed_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0,
                        help="the measured seconds per load that device_feed is given")
    parser.add_argument("--ratio", type=float,
                        help="also run with this share of requests traced "
                             "(parentbased_traceidratio)")
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
