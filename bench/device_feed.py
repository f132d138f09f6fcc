"""Does the CPU side feed a device? The real stack, MiniLM on an emulated device (issue 26).

    .venv/bin/python -m bench.device_feed [--profile h100-conservative/minilm] \
        [--clients 64,16 --texts 1,16] [--duration 10] [--rounds 3] [--json PATH]

Starts a private stack (gateway + worker + its runtime process, on this machine's
RabbitMQ; `app.tuning.bench_stack`) serving all-MiniLM-L6-v2 with SHOAL_EMULATE_DEVICE=<profile> in
the worker's environment: every CPU step of the real path runs (HTTP, JSON, publish,
broker, consume, batch forming, frames, decode, tokenize, pad, pool, results, replies),
and only the model's forward is a GIL-free wait of the profile's device time
(`runtimes.doubles.emulated`; `--profile list` lists the profiles). Then, per load
(`--clients` N[i] closed-loop clients, each sending `--texts` K[i] texts per request;
default 64 x 1 and 16 x 16), after `--warmup` s, over `--duration` s, `--rounds` times
(the table gives the median of the rounds):

- texts/s, p50/p99 request latency;
- device busy: the worker's `shoal_device_busy_seconds_total` (read from its /metrics at
  the window's ends) ÷ wall time, and device ms per batch (÷ `shoal_batch_seconds_count`);
- requests per message: how many requests the gateway coalesced into each task message
  (its `shoal_gateway_requests_per_message` histogram over the window);
- CPU µs per text of each process kind (gateway, worker, runtime, RabbitMQ; /proc
  utime+stime over the window, `app.tuning.cpu`), and the load generator's;
- the CPU side's time per batch: the larger of the runtime process's CPU per batch (its
  steps run one after another) and the whole stack's CPU per batch ÷ the machine's cores
  (they share them); and device ms per batch ÷ that (the "device/CPU" column). Above 1,
  the device is the bottleneck and a pipelined runtime can keep it busy; below 1, the CPU
  side cannot feed it whatever overlaps. "1.2x scale" is what the profile would have to
  be multiplied by for the device to take 1.2x the CPU side per batch at the batch shape
  seen (issue 26's target: a device just slower than the CPU side feeding it).

RabbitMQ is this machine's shared broker: its CPU includes whatever else uses it. The
worker runs PyTorch (the engine the emulated device stands in for; MiniLM's cpu profile
would pick ONNX Runtime) without a spare runtime (SHOAL_RUNTIME_SPARE=0; `--env` can set
either back): a spare imports torch while the first load runs, which is no cost per text.
Batches are formed with GPU-like limits (`--batch-items` 256, `--batch-tokens` 16,384,
as `bench.gpu_check` used on the H200), not the catalog's CPU profile. Results are the
emulator's zeros, never a model's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvloop

from app.tuning import markdown
from app.tuning.bench_stack import bench_stack
from app.tuning.cpu import process_kind, process_label
from app.tuning.inproc import machine_info
from app.tuning.load import LoadResult, prepare, run_load
from app.tuning.markdown import dash as _f
from app.tuning.mix import make_texts
from bench.lib import profiles
from bench.lib.args import add_env, env_of, int_list
from bench.lib.minilm import MINILM
from bench.lib.output import emit
from bench.lib.worker_metrics import WorkerCounters, counters_over

DEFAULT_PROFILE = "h100-conservative/minilm"  # issue 26's H100-class MiniLM: 0.25 ms + 0.2 us
KINDS = {"shoal gateway": "gateway", "shoal worker": "worker", "runtime": "runtime",
         "beam.smp": "rabbitmq"}
TARGET = 1.2  # device time per batch over the CPU side's, issue 26's target profile


# --- one measured window -----------------------------------------------------------------------


@dataclass
class Round:
    clients: int
    texts: int  # per request
    texts_per_s: float
    requests_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    device_busy: float  # busy seconds ÷ wall seconds
    batches_per_s: float
    texts_per_batch: float | None
    requests_per_message: float | None  # as the gateway published them (coalesced)
    device_ms_per_batch: float | None
    cpu_us_per_text: dict[str, float]  # by process kind, "total" (the stack), "client"
    runtime_cpu_ms_per_batch: float | None
    stack_cpu_ms_per_batch: float | None
    cpu_side_ms_per_batch: float | None  # max(runtime, stack ÷ cores)
    device_over_cpu: float | None
    scale_for_target: float | None  # the profile x this: device = TARGET x the CPU side
    simulated: str | None  # the X-Simulated header results came back with


def _per_text(level: LoadResult, texts: int) -> dict[str, float]:
    """CPU µs per text by process kind (summed over processes of a kind), the stack's
    total and the load generator's."""
    out: dict[str, float] = {}
    for label, ms in level.cpu_ms_per_request.items():
        if label == "total":
            continue
        kind = KINDS.get(process_kind(label), process_kind(label))
        out[kind] = out.get(kind, 0.0) + ms * 1000 / texts
    out["total"] = sum(out.values())
    if level.client_cpu_ms_per_request is not None:
        out["client"] = level.client_cpu_ms_per_request * 1000 / texts
    return out


def summarise(level: LoadResult, texts: int, before: WorkerCounters, after: WorkerCounters,
              cores: int) -> Round:
    wall = after.at - before.at
    batches = after.batches - before.batches
    busy = after.device_busy_s - before.device_busy_s
    per_text = _per_text(level, texts) if level.requests else {}
    texts_done = level.items
    runtime_ms = stack_ms = side_ms = ratio = scale = None
    device_ms = busy * 1000 / batches if batches else None
    if batches and per_text:
        runtime_ms = per_text.get("runtime", 0.0) * texts_done / batches / 1000
        stack_ms = per_text["total"] * texts_done / batches / 1000
        side_ms = max(runtime_ms, stack_ms / cores)
        if device_ms and side_ms:
            ratio = device_ms / side_ms
            scale = TARGET / ratio
    return Round(
        clients=int(level.offered), texts=texts, texts_per_s=level.items_per_s,
        requests_per_s=level.req_per_s, p50_ms=level.p50_ms, p99_ms=level.p99_ms,
        errors=level.errors + level.dropped,
        device_busy=busy / wall if wall > 0 else 0.0,
        batches_per_s=batches / wall if wall > 0 else 0.0,
        texts_per_batch=(after.batch_items - before.batch_items) / batches if batches else None,
        requests_per_message=(after.messages_requests - before.messages_requests) / messages
        if (messages := after.messages - before.messages) else None,
        device_ms_per_batch=device_ms, cpu_us_per_text=per_text,
        runtime_cpu_ms_per_batch=runtime_ms, stack_cpu_ms_per_batch=stack_ms,
        cpu_side_ms_per_batch=side_ms, device_over_cpu=ratio, scale_for_target=scale,
        simulated=level.simulated_device,
    )


async def measure(endpoint: str, texts: list[str], clients: int, per_request: int,
                  args: argparse.Namespace, pids: list[int], metrics_url: str,
                  at_window: Callable[[], None] | None = None) -> Round:
    """One round; `at_window` is called when its measured window begins."""
    requests = [[texts[(i * per_request + j) % len(texts)] for j in range(per_request)]
                for i in range(len(texts))]
    prepared = prepare(endpoint, requests)
    now = time.perf_counter()  # run_load's window: [now + warmup, now + warmup + duration)
    gateway_metrics = endpoint.split("/v1/", 1)[0] + "/metrics"
    counters = asyncio.create_task(counters_over(metrics_url, MINILM, now + args.warmup,
                                                 now + args.warmup + args.duration,
                                                 gateway_metrics))
    if at_window is not None:
        asyncio.get_running_loop().call_later(args.warmup, at_window)
    level = await run_load(endpoint, prepared, "closed", clients, warmup=args.warmup,
                           duration=args.duration, timeout=args.timeout, cpu_pids=pids)
    before, after = await counters
    return summarise(level, per_request, before, after, os.cpu_count() or 1)


def _named(pids: list[int]) -> dict[str, int]:
    """The profiled processes by kind (gateway, worker, runtime), numbered if several."""
    named: dict[str, int] = {}
    for pid in pids:
        kind = KINDS.get(process_kind(process_label(pid)))
        if kind is None or kind == "rabbitmq":
            continue
        name = kind if kind not in named else f"{kind}-{pid}"
        named[name] = pid
    return named


def profiled(out: Path, pids: list[int], args: argparse.Namespace, spy: Any) -> None:
    """One more round with py-spy recording the stack over its window; its reports."""
    recorders: list[subprocess.Popen] = []

    def start() -> None:
        recorders.extend(profiles.record(_named(pids), args.duration, out))

    measured = spy(start)
    for recorder in recorders:
        recorder.wait(timeout=60)
    cores = {name: entry["cores"] for name, entry in profiles.report(out, args.duration).items()}
    print(f"  profiled at {measured.texts_per_s:,.0f} texts/s: {out}/*.top.txt "
          f"({', '.join(f'{k} {v:.2f}' for k, v in cores.items())} cores holding the GIL)",
          file=sys.stderr)


def median_round(rounds: list[Round]) -> Round:
    """Field by field, the median of the rounds (None where a round has none)."""
    def med(values: list[Any]) -> Any:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    first = rounds[0]
    kinds = list(dict.fromkeys(k for r in rounds for k in r.cpu_us_per_text))
    return Round(
        **{name: (med([getattr(r, name) for r in rounds])
                  if isinstance(getattr(first, name), int | float | None) else getattr(first, name))
           for name in Round.__dataclass_fields__ if name != "cpu_us_per_text"},
        cpu_us_per_text={k: med([r.cpu_us_per_text.get(k) for r in rounds]) for k in kinds},
    )


# --- the report ---------------------------------------------------------------------------------


def report(data: dict[str, Any]) -> str:
    profile = data["profile"]
    rows: list[Round] = [Round(**r) for r in data["loads"]]
    kinds = [k for k in ("gateway", "worker", "runtime", "rabbitmq", "total", "client")
             if any(k in r.cpu_us_per_text for r in rows)]
    lines = [
        f"`{data['command']}`",
        "",
        f"{data['date']}, {data['machine']['nproc']} cores ({data['machine']['cpu_model']}); "
        f"MiniLM on the EMULATED device `{profile['name']}`: {profile['fixed_ms']:g} ms + "
        f"{profile['per_token_us']:g} µs per padded token ({profile['source']}). "
        f"{data['duration']:g} s per round after {data['warmup']:g} s, median of "
        f"{data['rounds']} round(s); batches up to {data['batch_items']} texts / "
        f"{data['batch_tokens']} tokens.",
        "",
        *markdown.table(
            ["clients x texts", "texts/s", "p50 ms", "p99 ms", "device busy", "texts/batch",
             "requests/message", "device ms/batch", "CPU side ms/batch", "device/CPU", "1.2x scale",
             *(f"{k} µs/text" for k in kinds), "errors"],
            [[f"{r.clients} x {r.texts}", f"{r.texts_per_s:,.0f}", _f(r.p50_ms), _f(r.p99_ms),
              f"{r.device_busy:.1%}", _f(r.texts_per_batch), _f(r.requests_per_message),
              _f(r.device_ms_per_batch, ".2f"),
              _f(r.cpu_side_ms_per_batch, ".2f"), _f(r.device_over_cpu, ".2f"),
              _f(r.scale_for_target, ".1f"), *(_f(r.cpu_us_per_text.get(k), ".0f") for k in kinds),
              f"{r.errors:g}"] for r in rows],
            align="l" + "r" * (len(kinds) + 11)),
    ]
    marked = {r.simulated for r in rows}
    lines += ["", "CPU side ms/batch = max(runtime CPU per batch, stack CPU per batch ÷ "
              f"{data['machine']['nproc']} cores); stack = gateway + worker + runtime + "
              "RabbitMQ (client: the load generator, not counted). Results marked simulated "
              f"by the runtime (X-Simulated): {', '.join(sorted(m or 'no' for m in marked))}."]
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.device_feed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="an emulated device profile (`list` lists them) or fixed_ms,per_token_us")
    p.add_argument("--clients", type=int_list, default=[64, 16], help="clients per load")
    p.add_argument("--texts", type=int_list, default=[1, 16],
                   help="texts per request per load (paired with --clients; one value: all)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per round")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each")
    p.add_argument("--rounds", type=int, default=3, help="rounds per load (median reported)")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout, seconds")
    p.add_argument("--batch-items", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=16_384)
    add_env(p, "more environment for the stack (repeatable)")
    p.add_argument("--json", type=Path, help="also write every round's numbers here")
    p.add_argument("--py-spy", type=Path, metavar="DIR",
                   help="after each load's rounds, one more round with `py-spy record` on "
                        "the gateway, the worker and the runtime: DIR/<load>/<kind>.txt and "
                        "its .top.txt (each thread's top functions)")
    args = p.parse_args(argv)
    if args.profile == "list":
        return args
    if len(args.texts) == 1:
        args.texts = args.texts * len(args.clients)
    if len(args.texts) != len(args.clients):
        p.error("--texts takes one value, or one per --clients value")
    if args.duration <= 0 or args.warmup < 0 or args.rounds < 1:
        p.error("--duration must be > 0, --warmup >= 0, --rounds >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from app.tuning.stack import free_port
    from runtimes.doubles.profiles import ENV, PROFILES, parse_profile

    if args.profile == "list":
        for p in PROFILES.values():
            print(f"{p.name:26} {p.fixed_ms:8.4f} ms + {p.per_token_us:7.4f} us/token  {p.source}")
        return 0
    profile = parse_profile(args.profile)
    if profile is None:
        print("error: --profile must name an emulated device; this benchmark never runs the "
              "real model", file=sys.stderr)
        return 2
    metrics_port = free_port()
    # No spare runtime: it imports torch and transformers (~7 s of CPU) while the first load
    # runs, billed as the runtime's per text; a crash is not what this measures. PyTorch:
    # the emulated device is its seam (MiniLM's cpu profile would pick ONNX Runtime).
    env = {ENV: args.profile, "SHOAL_WORKER_METRICS_PORT": str(metrics_port),
           "SHOAL_RUNTIME": "pytorch", "SHOAL_RUNTIME_SPARE": "0",
           "SHOAL_BATCH_MAX_ITEMS": str(args.batch_items),
           "SHOAL_BATCH_MAX_TOKENS": str(args.batch_tokens),
           **env_of(args.env)}
    texts = make_texts(256)
    rounds: list[dict[str, Any]] = []
    loads: list[Round] = []
    print(f"starting a stack on the emulated device {profile.name}...", file=sys.stderr)
    with bench_stack(MINILM, env) as stack:
        logs = "".join(p.read_text(errors="replace") for p in stack.log_dir.glob("*.log"))
        if "EMULATED device" not in logs:
            print(f"error: the worker's runtime did not log an emulated device; refusing to "
                  f"measure what may be the real model (logs: {stack.log_dir})", file=sys.stderr)
            return 1
        endpoint = f"{stack.url}/v1/encode/{MINILM}"
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        for clients, per_request in zip(args.clients, args.texts, strict=True):
            measured = []
            for n in range(args.rounds):
                r = uvloop.run(measure(endpoint, texts, clients, per_request, args, stack.pids,
                                       metrics_url))
                print(f"  {clients} x {per_request}, round {n + 1}: {r.texts_per_s:,.0f} "
                      f"texts/s, device busy {r.device_busy:.1%}, device/CPU "
                      f"{_f(r.device_over_cpu, '.2f')}", file=sys.stderr)
                measured.append(r)
                rounds.append(asdict(r))
            loads.append(median_round(measured))
            if args.py_spy:
                profiled(args.py_spy / f"{clients}x{per_request}", stack.pids, args,
                         lambda start, c=clients, k=per_request: uvloop.run(measure(
                             endpoint, texts, c, k, args, stack.pids, metrics_url, start)))
    data = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.device_feed", *sys.argv[1:]]),
        "machine": machine_info(), "model": MINILM, "profile": asdict(profile),
        "duration": args.duration, "warmup": args.warmup, "rounds": args.rounds,
        "batch_items": args.batch_items, "batch_tokens": args.batch_tokens,
        "loads": [asdict(r) for r in loads], "every_round": rounds,
    }
    emit(report(data), data, args.json)
    return 0 if all(r.texts_per_s > 0 for r in loads) else 1


if __name__ == "__main__":
    sys.exit(main())
