"""`shoal bench`: load a gateway with a realistic request mix and find the knee.

    shoal bench --start-stack --env SHOAL_RUNTIME=sim --sweep --mode open \\
        --mix-items pareto:1.2:1:64 --mix-words uniform:5:40 --png knee.png --json knee.json
    shoal bench --url http://127.0.0.1:8080 --loads 1,4,16,64 --duration 10

Each load level runs `--warmup` uncounted seconds, then `--duration` measured
ones (app/tuning/load.py says what is counted). `--sweep` raises the load
geometrically from `--start` until p99 passes `--p99-factor` x the p99 at the
lowest load, throughput stops growing, or `--max-load` (app/tuning/knee.py); the
knee is the highest throughput before that. Results from a simulated runtime
(responses with X-Simulated) are marked SIMULATED everywhere: they show how
the stack batches and queues, not what a model costs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.tuning import markdown
from app.tuning.knee import Knee, SweepPolicy, find_knee, next_load
from app.tuning.markdown import fmt
from app.tuning.mix import MixSummary, describe, make_requests, summarize

if TYPE_CHECKING:  # app.tuning.load brings numpy: imported when a bench runs, not to parse
    from app.tuning.load import BodyFn, LoadResult, Prepared

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_QUERY = "which animal sits near the river"
OPS = ("encode", "score", "extract", "classify")
INPROC_BATCHES = [1, 8, 32]
INPROC_TEXTS = 256  # enough for a stable rate, few enough to stay a short prelude


def _loads(value: str) -> list[float]:
    try:
        loads = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {value!r}") from None
    if not loads or any(not (math.isfinite(v) and v > 0) for v in loads):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {value!r}")
    return loads


def _env(value: str) -> tuple[str, str]:
    name, sep, setting = value.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {value!r}")
    return name, setting


def _options(value: str) -> dict[str, Any]:
    try:
        options = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--options is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError("--options must be a JSON object")
    return options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load a gateway, find the knee (app/cli/bench.py)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8080",
                       help="a running gateway (default %(default)s)")
    where.add_argument("--start-stack", action="store_true",
                       help="start a private worker + gateway for this run")
    p.add_argument("--env", type=_env, action="append", default=[], metavar="NAME=VALUE",
                   help="setting for --start-stack, e.g. SHOAL_RUNTIME=sim (repeatable)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model id (default %(default)s)")
    p.add_argument("--op", choices=OPS, default="encode",
                   help="operation: the path is /v1/{op}/{model} (default %(default)s)")
    p.add_argument("--path", help="HTTP path instead of /v1/{op}/{model}")
    p.add_argument("--query", default=DEFAULT_QUERY, help="the query of --op score")
    p.add_argument("--options", type=_options,
                   help='request options as JSON, e.g. \'{"labels": ["a", "b"]}\'')
    p.add_argument("--mode", choices=("closed", "open"), default="closed",
                   help="closed: N clients, one request each at a time; "
                        "open: Poisson arrivals at R req/s (default %(default)s)")
    loads = p.add_mutually_exclusive_group()
    loads.add_argument("--loads", type=_loads,
                       help="explicit comma-separated loads: clients (closed) or req/s (open)")
    loads.add_argument("--sweep", action="store_true",
                       help="search for the knee (the default when --loads is not given)")
    p.add_argument("--start", type=float,
                   help="first load of --sweep (default 1 client, or 4 req/s open)")
    p.add_argument("--growth", type=float, default=2.0,
                   help="--sweep multiplies the load by this (default %(default)s)")
    p.add_argument("--max-load", type=float,
                   help="--sweep stops here (default 256 clients, or 4096 req/s open)")
    p.add_argument("--mix-items", default="1",
                   help="texts per request: N, uniform:A:B, pareto:SHAPE:MIN:MAX, "
                        "lognormal:MU:SIGMA:MIN:MAX, choice:A,B,... (default %(default)s)")
    p.add_argument("--mix-words", default="uniform:5:15",
                   help="words per text, same forms (default %(default)s)")
    p.add_argument("--distinct", type=int, default=500,
                   help="distinct requests generated, then cycled (default %(default)s)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per load")
    p.add_argument("--warmup", type=float, default=2.0, help="uncounted seconds before each")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout, seconds")
    p.add_argument("--max-connections", type=int, default=256,
                   help="open loop: connection cap; arrivals beyond it are dropped")
    p.add_argument("--p99-factor", type=float, default=2.0,
                   help="the knee: p99 within this x the p99 at the lowest load")
    p.add_argument("--max-error-rate", type=float, default=0.01,
                   help="a load with more errors (or drops) than this is past the knee")
    p.add_argument("--seed", type=int, default=0, help="seed of the mix and the arrivals")
    p.add_argument("--json", type=Path, help="write every point, the knee and the mix here")
    p.add_argument("--png", type=Path, help="plot throughput and latency against load here")
    p.add_argument("--inproc", action="store_true",
                   help="first measure the model in process on the same texts (dense only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=functools.partial(bench, p))


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check alone (exit 2 with the usage), and the defaults that
    depend on --mode."""
    if args.env and not args.start_stack:
        parser.error("--env applies to --start-stack only")
    if args.duration <= 0 or args.warmup < 0 or args.timeout <= 0:
        parser.error("--duration and --timeout must be > 0, --warmup >= 0")
    if args.distinct < 1 or args.max_connections < 1:
        parser.error("--distinct and --max-connections must be >= 1")
    if args.p99_factor < 1:
        parser.error("--p99-factor must be >= 1")
    if args.growth <= 1:
        parser.error("--growth must be > 1")
    if args.inproc and args.op != "encode":
        parser.error("--inproc measures dense encoders only (--op encode)")
    closed = args.mode == "closed"
    if args.start is None:
        args.start = 1.0 if closed else 4.0
    if args.max_load is None:
        args.max_load = max(args.start, 256.0 if closed else 4096.0)
    whole = [*(args.loads or []), args.start, args.max_load]
    if closed and any(v != int(v) for v in whole):
        parser.error("closed loop loads are client counts: whole numbers")
    if args.start > args.max_load:
        parser.error("--start is above --max-load")
    args.sweep = args.loads is None


def body_for(op: str, query: str, options: dict[str, Any] | None) -> BodyFn:
    """A request body from a list of texts, for the operation."""
    from app.tuning.load import items_body

    def body(texts: list[str]) -> dict[str, Any]:
        out = items_body(texts)
        if op == "score":
            out["query"] = query
        if options:
            out["options"] = options
        return out
    return body


# --------------------------------------------------------------------------- in process


def dense_model_ref(model: str, env: dict[str, str]) -> str:
    """The local directory of a dense catalog model; ValueError if not dense or not local."""
    from tasks.catalog import load_catalog
    from tasks.settings import get_settings
    from tasks.sources import resolve_source

    directory = Path(env.get("SHOAL_CATALOG_DIR") or get_settings().catalog_dir)
    entry = load_catalog(directory).get(model)
    if entry is None:
        raise ValueError(f"{model} is not in the catalog at {directory}")
    if entry.adapter != "dense":
        raise ValueError(f"--inproc measures dense models only; {model} is {entry.adapter}")
    return resolve_source(entry.source)


def measure_inproc(model: str, env: dict[str, str],
                   requests: list[list[str]]) -> dict[str, Any]:
    from app.tuning.inproc import inproc_throughput, medians

    texts = [t for r in requests for t in r][:INPROC_TEXTS]
    passes = inproc_throughput(texts, INPROC_BATCHES, 3, dense_model_ref(model, env))
    rates = medians(passes)
    return {"texts": len(texts), "passes": passes, "items_per_s": rates,
            "best_items_per_s": max(rates.values())}


# --------------------------------------------------------------------------- report


def simulated_banner(levels: list[LoadResult]) -> str | None:
    devices = sorted({r.simulated_device or "true" for r in levels if r.simulated})
    if not devices:
        return None
    return (f"**SIMULATED** (X-Simulated: {', '.join(devices)}): a simulated runtime answered; "
            "these numbers show the stack's batching and queueing, not a model's speed.")


def table(levels: list[LoadResult], knee: Knee | None,
          inproc_best: float | None = None) -> list[str]:
    open_loop = any(r.mode == "open" for r in levels)
    head = ["load", "req/s", "items/s", "p50 ms", "p90 ms", "p99 ms", "errors"]
    head += ["dropped"] if open_loop else []
    head += ["batch requests"]
    head += ["% of in-process"] if inproc_best else []
    rows = []
    for r in levels:
        load = f"{r.offered:g}"
        if knee is not None and r.offered == knee.point.load:
            load = f"**{load}** (knee)"
        cells = [load, f"{r.req_per_s:.1f}", f"{r.items_per_s:.1f}", fmt(r.p50_ms),
                 fmt(r.p90_ms), fmt(r.p99_ms), str(r.errors)]
        cells += [str(r.dropped)] if open_loop else []
        cells += [fmt(r.median_batch_requests, "g")]
        cells += [f"{100 * r.items_per_s / inproc_best:.0f}%"] if inproc_best else []
        rows.append(cells)
    return markdown.table(head, rows)


def knee_line(knee: Knee | None, levels: list[LoadResult]) -> str:
    if knee is None:
        return "Knee: none (no successful responses, or too many errors, at the lowest load)."
    level = levels[knee.index]
    if level.mode == "open":
        unit = "req/s offered"
    else:
        unit = "client" if level.offered == 1 else "clients"
    return (f"Knee: {level.offered:g} {unit}: {level.req_per_s:.1f} req/s, "
            f"{level.items_per_s:.1f} items/s, p50 {fmt(level.p50_ms)} ms, "
            f"p99 {fmt(level.p99_ms)} ms. Why: {knee.reason}.")


def report(meta: dict[str, Any], mix: MixSummary, levels: list[LoadResult], knee: Knee | None,
           stop: str | None, inproc: dict[str, Any] | None) -> str:
    banner = simulated_banner(levels)
    lines = [f"# shoal bench: {meta['model']}, {meta['mode']} loop", ""]
    if banner:
        lines += [banner, ""]
    lines += [
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- endpoint: {meta['endpoint']}",
        f"- mix: {describe(mix)}",
        f"- {meta['duration']:g} s measured per load after {meta['warmup']:g} s warm-up",
    ]
    best = inproc["best_items_per_s"] if inproc else None
    if inproc:
        rates = ", ".join(f"batch {b}: {v:.1f}" for b, v in inproc["items_per_s"].items())
        lines.append(f"- in process (same texts, items/s, median of 3): {rates}")
    lines += ["", *table(levels, knee, best), "", knee_line(knee, levels)]
    if stop:
        lines.append(f"Sweep stopped: {stop}.")
    kinds = {f"{r.offered:g}": r.error_kinds for r in levels if r.error_kinds}
    if kinds:
        lines.append(f"Errors by kind, per load: {kinds}")
    if banner:
        lines += ["", banner]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def _progress(enabled: bool, total: int | None) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="load", desc="shoal bench", file=sys.stderr,
                disable=not enabled, leave=False)


def sweep(args: argparse.Namespace, endpoint: str,
          prepared: list[Prepared]) -> tuple[list[LoadResult], str | None]:
    """Every load level, explicit or searched; (results, why the sweep stopped)."""
    import uvloop

    from app.tuning.load import run_load

    policy = SweepPolicy(start=args.start, growth=args.growth, max_load=args.max_load,
                         p99_factor=args.p99_factor, max_error_rate=args.max_error_rate,
                         integer=args.mode == "closed")
    levels: list[LoadResult] = []
    pending = list(args.loads) if args.loads else None
    stop: str | None = None
    with _progress(not args.no_progress, len(pending) if pending else None) as bar:
        while True:
            if pending is not None:
                if not pending:
                    break
                load = pending.pop(0)
            else:
                step = next_load([r.point() for r in levels], policy)
                if step.load is None:
                    stop = step.reason
                    break
                load = step.load
            bar.set_description(f"load {load:g}")
            level = uvloop.run(run_load(
                endpoint, prepared, args.mode, load, warmup=args.warmup,
                duration=args.duration, timeout=args.timeout,
                max_connections=args.max_connections, seed=args.seed + len(levels)))
            levels.append(level)
            bar.update(1)
            bar.set_postfix_str(f"{level.req_per_s:.1f} req/s, p99 {fmt(level.p99_ms)} ms, "
                                f"{level.errors + level.dropped} errors")
    return levels, stop


def bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check(parser, args)
    try:
        requests = make_requests(args.distinct, args.mix_items, args.mix_words, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mix = summarize(requests, args.mix_items, args.mix_words, args.seed)
    path = args.path or f"/v1/{args.op}/{args.model}"
    body = body_for(args.op, args.query, args.options)
    env = dict(args.env)
    inproc = None
    if args.inproc:
        print("in-process ceiling...", file=sys.stderr)
        try:
            inproc = measure_inproc(args.model, env, requests)
        except (ValueError, OSError, RuntimeError) as exc:
            print(f"error: --inproc: {exc}", file=sys.stderr)
            return 2
    if not args.start_stack:
        return measure(args, args.url.rstrip("/"), path, body, requests, mix, inproc)
    from app.tuning.bench_stack import bench_stack

    print("starting a private stack...", file=sys.stderr)
    probe = (path, json.dumps(body(requests[0][:1])).encode())
    with bench_stack(args.model, env, probe=probe) as stack:
        return measure(args, stack.url, path, body, requests, mix, inproc)


def measure(args: argparse.Namespace, url: str, path: str, body: BodyFn,
            requests: list[list[str]], mix: MixSummary, inproc: dict[str, Any] | None) -> int:
    from app.tuning.inproc import machine_info
    from app.tuning.load import prepare
    from app.tuning.stack import gateway_ready

    why = gateway_ready(url)
    if why is not None:
        print(f"error: the gateway at {url} is not ready ({why}); start one (`shoal gateway` "
              "and `shoal worker`) or use --start-stack", file=sys.stderr)
        return 2
    endpoint = f"{url}{path}"
    prepared = prepare(endpoint, requests, body)
    levels, stop = sweep(args, endpoint, prepared)
    knee = find_knee([r.point() for r in levels], args.p99_factor, args.max_error_rate)
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["shoal", *args.argv]),
        "model": args.model,
        "endpoint": endpoint,
        "mode": args.mode,
        "duration": args.duration,
        "warmup": args.warmup,
    }
    print(report(meta, mix, levels, knee, stop, inproc))
    simulated = any(r.simulated for r in levels)
    if args.json:
        raw = {
            **meta,
            "machine": machine_info(),
            "simulated": simulated,
            "settings": {k: v for k, v in vars(args).items()  # the command's own options
                         if k not in ("json", "png", "env", "command", "run", "argv")}
                        | {"env": dict(args.env)},
            "mix": asdict(mix),
            "inproc": inproc,
            "points": [asdict(r) | {"error_rate": r.error_rate} for r in levels],
            "knee": asdict(knee) if knee else None,
            "sweep_stop": stop,
        }
        args.json.write_text(json.dumps(raw, indent=2, default=str) + "\n")
    if args.png and levels:
        from app.tuning.plot import plot_sweep

        plot_sweep(args.png, levels, model=args.model, mode=args.mode,
                   knee_load=knee.point.load if knee else None,
                   p99_limit_ms=knee.limit_p99_ms if knee else None, simulated=simulated)
    if not any(r.requests for r in levels):
        print(f"error: every request to {endpoint} failed", file=sys.stderr)
        return 1
    return 0
