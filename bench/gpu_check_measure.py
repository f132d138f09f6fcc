"""The measuring half of bench.gpu_check: the runtime in process and through its process
(with the worker's batching, `Former`), and the fit of a batch's device time; the script
itself (bench.gpu_check) runs them and prints and plots the rows."""

from __future__ import annotations

import json
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.tuning.stats import percentile
from bench.lib.minilm import texts
from tasks.served import batch_device_ms


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


def fit_cost(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of device seconds = a + b * padded tokens: (a in ms, b in us)."""
    xs = [float(p) for p, _ in points]
    ys = [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return max(0.0, my - b * mx) * 1000, b * 1e6


NVML: NvmlBusy | None = None  # set by `main` for the device it checks
