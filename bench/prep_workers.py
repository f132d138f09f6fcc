"""How texts/s scale with the number of preparation workers, where preparation is the limit.

    .venv/bin/python -m bench.prep_workers [--workers 1,2] [--modes processes,threads]
        [--profile h100-graphs/minilm] [--texts 16] [--duration 8] [--rounds 3] [--json PATH]

MiniLM (the packaged weights) on an emulated device fast enough that the host's work is
the limit (`h100-graphs/minilm`: 0.3 ms + 0.0644 us per padded token, an H100 without
launch gaps; `runtimes.doubles.emulated`), fed batches of 256 texts (requests of `--texts`
texts each, 5-40 words) as fast as it answers, without the gateway or the broker (they
are `bench.device_feed`'s): what one device's preparation (decode, tokenize, pad, pool,
results, frames) can carry, per way of spreading it over cores:

- processes: `runtimes.worker_side.replicas.ReplicaSet` of N runtime processes
(SHOAL_RUNTIME_REPLICAS
  = N), their emulated passes queued on one shared device; N x 2 batches in flight
  (each process pipelines two, as the worker hands them);
- threads: one `runtimes.child_side.host.ModelHost` in this process, N threads each running whole
  batches (`run_batch`) on it: what preparation threads inside one runtime would give
  (they share its GIL).

A worker is a core: each runtime process is pinned to a core of its own (its pipeline's
three threads share it), the threads mode's process to N cores, and the tokenizer runs on
the calling thread (TOKENIZERS_PARALLELISM=false). Unpinned, one runtime process already
spreads over more than one core (its stages overlap where the tokenizer releases the GIL).
Reported per mode and N: texts/s, device busy (the device time the results carry ÷
wall), CPU µs per text of the runtime processes (or this process, for threads) and of
the feeding side, and the ratio to N=1 of the same round. Rounds alternate the settings;
the table gives medians over rounds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.cpu import cpu_seconds
from bench.lib.args import int_list
from bench.lib.minilm import MINILM, texts
from bench.lib.output import emit
from tasks.served import batch_device_ms

BATCH_TEXTS = 256
ENV = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
CORES = os.cpu_count() or 1


def pin(pid: int, cores: set[int]) -> None:
    """A worker is a core: a process's threads (all of them: the pipeline's stages and the
    tokenizer's) share the cores it is pinned to."""
    for task in os.listdir(f"/proc/{pid or os.getpid()}/task"):
        os.sched_setaffinity(int(task), cores)


@dataclass(frozen=True)
class Point:
    mode: str
    workers: int
    round: int
    texts_per_s: float
    device_busy: float
    runtime_us_per_text: float  # the preparing processes (threads: this process)
    feeder_us_per_text: float  # this process, feeding (processes mode only)


def batches(per_request: int, count: int) -> list[list[Any]]:
    """`count` batches of BATCH_TEXTS texts in requests of `per_request`, made up front."""
    from runtimes.base import Request

    out = []
    for b in range(count):
        requests = []
        for r in range(BATCH_TEXTS // per_request):
            items = [{"text": t} for t in texts(per_request, seed=b * 10_000 + r)]
            requests.append(Request(f"{b}-{r}", "encode", {"items": items}))
        out.append(requests)
    return out


def drive(run: Callable[[list[Any]], list[Any]], feeders: int, work: list[list[Any]],
          duration: float, warmup: float, cpu_pids: list[int]
          ) -> tuple[float, float, float, float]:
    """`feeders` threads run batches of `work` round-robin until `duration` s after the
    warm-up: (texts/s, device busy, CPU s of `cpu_pids`, CPU s of this process)."""
    start = time.perf_counter()
    window = (start + warmup, start + warmup + duration)
    done = [0]
    busy = [0.0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def feed(k: int) -> None:
        n = k
        while (now := time.perf_counter()) < window[1] and not errors:
            outcomes = run(work[n % len(work)])
            n += feeders
            bad = next((o for o in outcomes if o.error_code is not None), None)
            if bad is not None:
                errors.append(RuntimeError(f"{bad.error_code}: {bad.error_message}"))
            if now >= window[0]:
                with lock:
                    done[0] += sum(len(r.kwargs["items"]) for r in work[(n - feeders)
                                                                        % len(work)])
                    busy[0] += (batch_device_ms(o.result for o in outcomes) or 0.0) / 1000

    threads = [threading.Thread(target=feed, args=(k,), daemon=True) for k in range(feeders)]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, window[0] - time.perf_counter()))
    cpu_before = sum(cpu_seconds(p) for p in cpu_pids)
    own_before = time.process_time()
    time.sleep(max(0.0, window[1] - time.perf_counter()))
    cpu_after = sum(cpu_seconds(p) for p in cpu_pids)
    own_after = time.process_time()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return (done[0] / duration, busy[0] / duration, cpu_after - cpu_before,
            own_after - own_before)


def processes(workers: int, work: list[list[Any]], duration: float, warmup: float,
              round_: int) -> Point:
    from runtimes.worker_side.process import ProcessRuntime
    from runtimes.worker_side.replicas import ReplicaSet
    from tasks.settings import PACKAGED_CATALOG_DIR

    profile_env = {**ENV, "SHOAL_EMULATE_DEVICE": os.environ["SHOAL_EMULATE_DEVICE"]}

    def start(index: int, env: dict[str, str]) -> ProcessRuntime:
        return ProcessRuntime(PACKAGED_CATALOG_DIR, [MINILM], threads=1, spare=False,
                              env={**profile_env, **env}, pipeline_depth=2)

    replicas = ReplicaSet(start, workers)
    try:
        pids = [p for p in replicas.pids if p is not None]
        for index, pid in enumerate(pids):
            pin(pid, {index % CORES})
        rate, busy, cpu, own = drive(lambda b: replicas.run_batch(MINILM, b),
                                     replicas.capabilities.pipeline_depth, work, duration, warmup,
                                     pids)
    finally:
        replicas.close()
    texts_ = rate * duration
    return Point("processes", workers, round_, rate, busy, cpu / texts_ * 1e6,
                 own / texts_ * 1e6)


def threads(workers: int, work: list[list[Any]], duration: float, warmup: float,
            round_: int) -> Point:
    from runtimes.child_side.host import ModelHost
    from tasks.catalog import load_catalog
    from tasks.settings import PACKAGED_CATALOG_DIR

    host = ModelHost(threads=1)
    host.load(load_catalog(PACKAGED_CATALOG_DIR).require([MINILM]))
    everywhere = os.sched_getaffinity(0)
    pin(0, set(range(min(workers, CORES))))
    try:
        rate, busy, _, own = drive(lambda b: host.run_batch(MINILM, b), workers, work,
                                   duration, warmup, [])
    finally:
        pin(0, everywhere)
        host.close()
    return Point("threads", workers, round_, rate, busy, own / (rate * duration) * 1e6, 0.0)


def summary(points: list[Point]) -> list[dict[str, Any]]:
    """Medians per (mode, workers), with the median same-round ratio to one worker."""
    rows = []
    for mode in dict.fromkeys(p.mode for p in points):
        ones = {p.round: p.texts_per_s for p in points if p.mode == mode and p.workers == 1}
        for workers in sorted({p.workers for p in points if p.mode == mode}):
            mine = [p for p in points if p.mode == mode and p.workers == workers]
            ratios = [p.texts_per_s / ones[p.round] for p in mine if p.round in ones]
            rows.append({
                "mode": mode, "workers": workers, "rounds": len(mine),
                "texts_per_s": statistics.median(p.texts_per_s for p in mine),
                "range": (min(p.texts_per_s for p in mine), max(p.texts_per_s for p in mine)),
                "device_busy": statistics.median(p.device_busy for p in mine),
                "runtime_us": statistics.median(p.runtime_us_per_text for p in mine),
                "feeder_us": statistics.median(p.feeder_us_per_text for p in mine),
                "ratio": statistics.median(ratios) if ratios else None,
            })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    return "\n".join(markdown.table(
        ["mode", "workers", "texts/s (median)", "range", "device busy",
         "µs/text preparing", "µs/text feeding", "x one worker (same round)"],
        [[r["mode"], r["workers"], f"{r['texts_per_s']:,.0f}",
          f"{r['range'][0]:,.0f}-{r['range'][1]:,.0f}", f"{r['device_busy']:.1%}",
          f"{r['runtime_us']:.1f}", markdown.dash(r["feeder_us"] or None),
          markdown.fmt(r["ratio"], ".2f")] for r in rows], align="llrrrrrr"))


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Texts/s by workers, processes beside threads, with N x one worker as a dotted line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for mode, style in (("processes", "o-"), ("threads", "s--")):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        workers = [r["workers"] for r in mine]
        line = ax.plot(workers, [r["texts_per_s"] for r in mine], style,
                       label=f"{mode} (x{mine[-1]['ratio']:.2f} at {workers[-1]})")[0]
        ax.plot(workers, [mine[0]["texts_per_s"] * n for n in workers], ":",
                color=line.get_color(), alpha=0.6)
    ax.set_xlabel("preparation workers (each pinned to a core)")
    ax.set_ylabel("texts/s (median of rounds)")
    ax.set_xticks(sorted({r["workers"] for r in rows}))
    ax.set_ylim(bottom=0)
    ax.legend(title="dotted: N x one worker")
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prep_workers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int_list, default=[1, 2])
    parser.add_argument("--modes", default="processes,threads")
    parser.add_argument("--profile", default="h100-graphs/minilm")
    parser.add_argument("--texts", type=int, default=16, help="texts per request")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None, help="plot texts/s by workers")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="table (and --png) of an earlier run's --json, not a new run")
    args = parser.parse_args(argv)
    title = "MiniLM preparation on an emulated H100 without launch gaps (bench.prep_workers)"
    if args.from_json:
        rows = json.loads(args.from_json.read_text())["rows"]
        print(table(rows))
        if args.png:
            plot(rows, args.png, title)
        return 0
    if BATCH_TEXTS % args.texts:
        parser.error(f"--texts must divide {BATCH_TEXTS}")
    # Before anything imports the emulator: this process (threads mode) emulates too.
    os.environ.update({**ENV, "SHOAL_EMULATE_DEVICE": args.profile})
    work = batches(args.texts, 32)
    modes = {"processes": processes, "threads": threads}
    points = []
    started = dt.datetime.now(dt.UTC)
    for round_ in range(args.rounds):
        for mode in args.modes.split(","):
            # Alternate the order within a round: neither setting always runs first.
            for workers in (args.workers if round_ % 2 == 0 else args.workers[::-1]):
                point = modes[mode](workers, work, args.duration, args.warmup, round_)
                print(f"round {round_ + 1}/{args.rounds} {mode} x{workers}: "
                      f"{point.texts_per_s:,.0f} texts/s, busy {point.device_busy:.1%}, "
                      f"{point.runtime_us_per_text:.1f} µs/text preparing", flush=True)
                points.append(point)
    rows = summary(points)
    if args.png:
        plot(rows, args.png, title)
    head = (f"{started:%Y-%m-%d %H:%M} UTC, profile {args.profile}, batches of {BATCH_TEXTS} "
            f"texts in requests of {args.texts}, {os.cpu_count()} cores\n\n")
    return emit(head + table(rows), {"points": [asdict(p) for p in points], "rows": rows,
                                     "args": vars(args) | {"json": str(args.json)}},
                args.json)


if __name__ == "__main__":
    raise SystemExit(main())
