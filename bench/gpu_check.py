"""`make gpu-check`: what shoal's PyTorch runtime does on a CUDA device, in one table.

    python -m bench.gpu_check [--json PATH] [--quick] [--cpu] [--stack | --stack-only]

Detects CUDA (without one it says so and exits 0; `--cpu` runs the same steps on the
CPU, small, to check the script itself). Then, for all-MiniLM-L6-v2 (the packaged
weights, or `--minilm DIR`) and models of bge-small's and bge-base's shapes (randomly
initialised from their configs: no hub here; speed does not depend on the weights'
values), loaded through the catalog and `from_pretrained` as a user's model is:

1. **in process** (`runtimes.child_side.host.ModelHost`, the real adapter path: parse, tokenize,
   pad, forward, pool, results) in fp32 and bf16, one batch after another of 1, 8, 32
   and 256 texts: texts/s, tokens/s, the device's busy fraction (CUDA events around the
   forward ÷ wall time), p50/p99 batch latency, and fp32-vs-bf16 parity (the least
   cosine of a text's two vectors); CUDA graphs and shape buckets on (the default,
   `runtimes.pytorch.buckets`), and MiniLM bf16 at 32 and 256 texts again with them off
   (`SHOAL_CUDA_GRAPHS=off`: eager PyTorch, every kernel launched from Python);
2. **through the runtime process** (`runtimes.worker_side.process.ProcessRuntime`: msgpack frames
   over the socket, as a worker runs it) with 1, 32 and 256 concurrent clients sending
   1 or 8 texts per request, batched as the worker's former does (up to the profile's
   item and token budget), one batch at a time (depth 1) and pipelined (depth 2: the
   runtime prepares the next batch while the device runs one): texts/s, device busy,
   request p50/p99;
3. a fit of the forward's device time per batch, a + b x padded tokens, per model and
   precision: the constants an emulated device of this GPU runs with
   (`runtimes.doubles.emulated`).

With `--stack` (after those) or `--stack-only`, the whole stack on this host too:
RabbitMQ and Redis unpacked from `make gpu-bundle`'s Debian packages, gateway, worker and
runtime, under the project's load generator (bench/gpu_stack.py; on a lent GPU host
`bash infra/gpu-host/check.sh` runs everything, see docs/runtimes.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.tuning import markdown
from bench import gpu_check_measure as measure
from bench.gpu_check_measure import Row, fit_cost, graphs_off, in_process, through_runtime
from bench.lib.minilm import MINILM, SHAPES, build_shaped, minilm_dir, write_catalog

# --- the models -----------------------------------------------------------------------------










# --- 1. in process --------------------------------------------------------------------------








# --- 2. through the runtime process ---------------------------------------------------------






# --- 3. the device's cost per batch ---------------------------------------------------------




# --- the run --------------------------------------------------------------------------------


def describe_device(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        info["bf16"] = torch.cuda.is_bf16_supported()
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            info["nvidia-smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20,
            ).stdout.strip()
    return info


def table(rows: list[Row]) -> str:
    return "\n".join(markdown.table(
        ["path", "model", "precision", "load", "texts/s", "tokens/s", "device busy",
         "GPU busy (NVML)", "p50 ms", "p99 ms", "parity (min cos fp32 vs bf16)"],
        [[r.path, r.model.rsplit("/", 1)[-1], r.precision, r.shape, f"{r.texts_per_s:,.0f}",
          f"{r.tokens_per_s:,.0f}", f"{r.device_busy:.3f}",
          markdown.fmt(r.extra.get("nvml_busy"), ".3f", ""), f"{r.p50_ms:.2f}",
          f"{r.p99_ms:.2f}", "" if r.parity is None else f"{r.parity:.5f}"] for r in rows],
        align="llllrrrrrrl"))


def plot(rows: list[Row], path: Path, title: str) -> Path:
    """Texts/s and device busy through the runtime process, one batch at a time against
    pipelined, per model and load."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    process = [r for r in rows if r.path.startswith("runtime-process") and "replicas" not in r.path]
    models = sorted({r.model for r in process})
    fig = Figure(figsize=(11, 3.6 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), 2, squeeze=False)
    for line, model in enumerate(models):
        loads = list(dict.fromkeys(r.shape for r in process if r.model == model))
        for column, (field_name, label) in enumerate((("texts_per_s", "texts/s"),
                                                      ("device_busy", "device busy"))):
            ax = axes[line][column]
            width = 0.4
            for k, depth in enumerate(("depth 1", "depth 2")):
                values = [next((getattr(r, field_name) for r in process if r.model == model
                                and r.shape == load and r.path.endswith(depth)), 0.0)
                          for load in loads]
                ax.bar([i + (k - 0.5) * width for i in range(len(loads))], values, width,
                       label="one batch at a time" if depth == "depth 1" else "pipelined")
            ax.set_xticks(range(len(loads)), [s.replace(" clients x ", "x") for s in loads],
                          rotation=20)
            ax.set_ylabel(label)
            ax.set_title(f"{model.rsplit('/', 1)[-1]}: {label}")
            if field_name == "device_busy":
                ax.set_ylim(0, 1)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--minilm", default=os.environ.get("SHOAL_GPU_CHECK_MINILM"),
                        help="MiniLM's model folder (default: the packaged weights)")
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU, small: a check of this script, not of a GPU")
    parser.add_argument("--quick", action="store_true", help="shorter measurements")
    parser.add_argument("--runtime-only", action="store_true",
                        help="only the runtime-process rows (no in-process rows, no fits)")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--plot", type=Path, default=None,
                        help="a PNG of the runtime-process rows (depth 1 against 2)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="plot (and print) an earlier run's --json instead of running")
    from bench import gpu_stack

    parser.add_argument("--stack", action="store_true", help="then the whole stack on this "
                        "host (bench.gpu_stack: RabbitMQ and Redis from make gpu-bundle's "
                        "debs, gateway, worker and runtime under app.tuning.load)")
    parser.add_argument("--stack-only", action="store_true", help="only the whole stack")
    gpu_stack.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        rows = [Row(**r) for r in saved["rows"]]
        print(table(rows))
        if args.plot:
            plot(rows, args.plot, f"shoal's PyTorch runtime on {saved['info'].get('gpu')}")
        return 0

    import torch

    from runtimes.worker_side.replicas import default_replicas

    if args.cpu:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda:0"
    else:
        print("gpu-check: no CUDA device found (torch.cuda.is_available() is False); "
              "nothing to check")
        return 0
    if args.stack_only:
        return gpu_stack.run_checked(args, args.minilm, args.cpu)
    small = args.cpu or args.quick
    seconds = args.seconds or (0.5 if small else 2.0)
    sizes = [1, 8, 32] if args.cpu else [1, 8, 32, 256]
    # One client again at the end: the same load once every shape has been seen (a
    # device's first batch of a new shape pays for choosing its kernels).
    loads = [(1, 1), (32, 8)] if args.cpu else [(1, 1), (1, 8), (32, 1), (32, 8), (256, 1),
                                                 (256, 8), (1, 1)]
    precisions = ["fp32", "bf16"]
    info = describe_device(device)
    print("gpu-check:", json.dumps(info), flush=True)
    measure.NVML = measure.NvmlBusy(device)
    started = time.perf_counter()
    rows: list[Row] = []
    fits: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-gpu-check-") as tmp:
        minilm = minilm_dir(args.minilm)
        models = {MINILM: minilm}
        shaped = ["bge-small-shape"] if args.cpu else list(SHAPES)
        for name in shaped:
            models[f"shoal-check/{name}"] = build_shaped(name, minilm, Path(tmp) / name)
        catalog_dir = write_catalog(Path(tmp) / "catalog", models)
        for model in [] if args.runtime_only else models:
            vectors = {}
            for precision in precisions:
                measured, vectors[precision], points = in_process(
                    catalog_dir, model, device, precision, sizes, seconds)
                a_ms, b_us = fit_cost(points)
                fits[f"{model} {precision}"] = {"a_ms": round(a_ms, 4), "b_us": round(b_us, 5)}
                rows.extend(measured)
                print(f"  in-process {model} {precision}: done at "
                      f"{time.perf_counter() - started:.0f}s", flush=True)
            cosines = (vectors["fp32"] * vectors["bf16"]).sum(axis=1)
            for row in rows:
                if row.model == model and row.precision == "bf16" and row.path == "in-process":
                    row.parity = float(cosines.min())
            if model == MINILM and device.startswith("cuda"):
                rows.extend(graphs_off(catalog_dir, model, device, sizes[-2:], seconds))
        for model in [MINILM, *(f"shoal-check/{n}" for n in shaped[:1])]:
            for depth in (1, 2):  # one batch at a time, and pipelined
                rows.extend(through_runtime(
                    catalog_dir, model, device, "bf16" if device.startswith("cuda") else "fp32",
                    loads, seconds, depth))
                print(f"  runtime-process {model} depth {depth}: done at "
                      f"{time.perf_counter() - started:.0f}s", flush=True)
        # Several runtime processes on the device (SHOAL_RUNTIME_REPLICAS's GPU default):
        # many cores prepare; 16-text requests as the target load.
        replicas = 2 if args.cpu else default_replicas(device)
        replica_loads = [(32, 16)] if args.cpu else [(1, 16), (32, 16), (256, 16), (256, 1)]
        for count in sorted({1, replicas}):
            rows.extend(through_runtime(
                catalog_dir, MINILM, device, "bf16" if device.startswith("cuda") else "fp32",
                replica_loads, seconds, 2, count))
            print(f"  runtime-process {MINILM} x{count}: done at "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
        if not args.runtime_only:  # where a batch's time goes, stage by stage
            from bench import stages

            precision = "bf16" if device.startswith("cuda") else "fp32"
            batch = 32 if args.cpu else 256
            stage_times = stages.measure(device, precision, batch, 16 if not args.cpu else 8,
                                         3 if args.cpu else 20, str(minilm))
            print(f"\nstages of one batch of {batch} texts, MiniLM {precision}:\n"
                  f"{stages.table(stage_times)}", flush=True)
    print()
    print(table(rows))
    print()
    print("device time per batch, least squares a + b x padded tokens:")
    for key, fit in fits.items():
        print(f"  {key}: a = {fit['a_ms']:.3f} ms, b = {fit['b_us']:.4f} us/token")
    print(f"\ngpu-check: {len(rows)} rows in {time.perf_counter() - started:.0f}s")
    if args.plot:
        plot(rows, args.plot, f"shoal's PyTorch runtime on {info.get('gpu', device)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"info": info, "rows": [asdict(r) for r in rows],
                                         "fits": fits}, indent=2) + "\n")
    if args.stack:  # the whole stack, after the runtime's own parts
        return gpu_stack.run_checked(args, args.minilm, args.cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
