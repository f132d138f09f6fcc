"""Bucketed shapes and CUDA graphs for the text encoders' forward passes (issue 38).

Eager PyTorch launches every kernel of a forward pass from Python: on an H200 a MiniLM
batch of 256 x 32 tokens paid 3-6 ms of launch gaps for well under 1 ms of GPU work. A
CUDA graph launches the whole pass at once, but only for the shapes it was captured at,
so a batch's inputs are padded up to a (rows, width) *bucket*:

- rows: powers of two and the 1.5x steps between them from 8 up (`ROWS`, 1 ... 1024), so
  at most a third of a bucket's rows are dummies past 8 rows;
- width: multiples of 16 up to 64, then 1.5x / 2x steps (`WIDTHS`, 16 ... 1024), capped
  at the model's own limit (which is then a bucket too): at most a third of the columns
  are padding past 48 tokens. GPU chunks are padded to multiples of 16 already
  (`runtimes.pytorch.text.GPU_WIDTH_MULTIPLE`);
- rows x width at most the family's padded-token budget per pass (its chunk budget), so
  a model has at most ~120 buckets and the largest one's working memory bounds the graph
  memory pool they share.

A dummy row has one real token (its mask 1 at column 0: attention never sees a row with
every key masked) and padding after it; extra columns are masked padding. Outputs come
back sliced to the batch's own rows and columns, so the families pool exactly what they
pooled before (their attention mask is the batch's own).

On CUDA, `load_model` captures one graph per bucket (`Buckets.capture`): every bucket is
run once eagerly (warm-up: kernel choices, cuBLAS workspaces, output shapes), then
captured on a side stream of the loading thread, largest first, into one shared memory
pool, `capture_error_mode="thread_local"` so a batch served by another thread meanwhile is
not disturbed. The graphs share their static inputs (one flat buffer per input) and their
output (each graph ends with a copy of the model's output into one flat buffer allocated
before the captures), so a model's graph memory is about its largest bucket's working set,
not the sum over buckets; the log line of the load says how long it took and how much, and
`graph_bytes` adds it to what the load reports (`runtimes.pytorch.engine`).

A replay runs on the calling thread's current stream (the runtime's device thread): the
inputs are copied into the static buffers, the graph is replayed, and the output returned
is a view of the shared output buffer. Stream order makes this safe without waiting: the
next replay's input copies queue behind this replay, and the caller's reads of the output
(pooling into a fresh tensor, a copy to the host) queue before the next replay, as every
family's forward does. So one thread at a time runs a model's passes (the runtime's
device thread does). The device clock (`device_time`) is billed around each replay.

What runs eagerly instead: a batch outside every bucket (wider than the widest, more rows
or padded tokens than the largest), inputs other than the ones captured, a batch with LoRA
rows (peft's mixed batches pick rows in Python; they are padded to a bucket all the same,
so the dummy rows go through the base model), and everything when graphs are off. Base
rows of a model that has LoRAs loaded do replay: peft leaves the base weights in place,
and the graph computes exactly the base model.

`SHOAL_CUDA_GRAPHS` in the runtime process's environment (a worker's runtime inherits the
worker's) decides, read at each model load:

- `auto` (default): buckets and graphs on a CUDA device, neither on a CPU (padding only
  costs a CPU compute);
- `on`: the same on CUDA, and bucket padding without graphs on a CPU;
- `buckets`: bucket padding only, on any device (the padding's own effect, and tests);
- `off`: neither: every pass eager at its own shape, as before.

Graphs are never attempted on a device other than CUDA, nor for a model whose forward a
stand-in device replaced (`runtimes.pytorch.device_seam`, CPU only): the stand-in's
forward sees the bucket's padded shape in `buckets`/`on` mode, as a bucketed device would.
A capture that fails logs a warning and leaves the model bucketed and eager.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtimes.pytorch.device_time import device_clock

log = logging.getLogger(__name__)

ENV = "SHOAL_CUDA_GRAPHS"
MODES = ("auto", "on", "buckets", "off")
_ALIASES = {"": "auto", "1": "on", "true": "on", "yes": "on", "0": "off", "false": "off",
            "no": "off", "none": "off"}

ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
WIDTHS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True, slots=True)
class Plan:
    """What one model's passes do: pad to buckets, and replay CUDA graphs."""

    buckets: bool
    graphs: bool


def configured_mode() -> str:
    """The SHOAL_CUDA_GRAPHS of this process (`MODES`); ValueError for another value."""
    value = os.environ.get(ENV, "").strip().lower()
    mode = _ALIASES.get(value, value)
    if mode not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return mode


def plan(mode: str, device: str, replaced_forward: bool = False) -> Plan:
    """What `mode` means for a model on `device` (see the module doc)."""
    cuda = device.startswith("cuda") and not replaced_forward
    if mode == "off":
        return Plan(False, False)
    if mode == "buckets":
        return Plan(True, False)
    if mode == "on":
        return Plan(True, cuda)
    return Plan(cuda, cuda)  # auto


def widths(limit: int) -> tuple[int, ...]:
    """The bucket widths of a model whose sequences stop at `limit` tokens."""
    below = tuple(w for w in WIDTHS if w < limit)
    return (*below, limit) if limit <= WIDTHS[-1] else below


def all_buckets(limit: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every (rows, width) bucket of a model: rows x width at most `max_tokens`."""
    return [(r, w) for w in widths(limit) for r in ROWS if r * w <= max_tokens]


def bucket_for(rows: int, width: int, limit: int, max_tokens: int) -> tuple[int, int] | None:
    """The smallest bucket that holds a (rows, width) batch, or None (it runs as it is)."""
    sizes = widths(limit)
    i, j = bisect.bisect_left(ROWS, rows), bisect.bisect_left(sizes, width)
    if rows < 1 or i == len(ROWS) or j == len(sizes):
        return None
    bucket = (ROWS[i], sizes[j])
    return bucket if bucket[0] * bucket[1] <= max_tokens else None


def fill(target: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], pad_id: int) -> None:
    """Lay a batch's `inputs` into the top-left corner of the bucket-shaped `target`
    tensors: padding (masked) in the extra columns, dummy rows (one token, attended)
    below."""
    rows, width = inputs["input_ids"].shape
    total_rows, total_width = target["input_ids"].shape
    for key, dst in target.items():
        dst[:rows, :width].copy_(inputs[key])
        blank = pad_id if key == "input_ids" else 0
        if width < total_width:
            dst[:rows, width:].fill_(blank)
        if rows < total_rows:
            dst[rows:].fill_(blank)
    if rows < total_rows:
        target["attention_mask"][rows:, 0] = 1


def sliced(output: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """A bucket's output cut back to the batch's rows (and columns, per-token outputs)."""
    return output[:rows, :width] if output.dim() >= 3 else output[:rows]


class Buckets:
    """One model's buckets, and its CUDA graphs when captured (see the module doc).

    It holds no reference to the model (the model's entry in a weak table holds it), so
    the graphs go with the model."""

    def __init__(self, *, field: str, device: str, pad_id: int, limit: int,
                 max_tokens: int, inputs: Sequence[str], plan: Plan) -> None:
        self.field = field  # the output the families read: last_hidden_state or logits
        self.device = device
        self.pad_id = pad_id
        self.limit = limit
        self.max_tokens = max(1, max_tokens)
        self.inputs = tuple(inputs)  # the inputs the graphs were captured with
        self.plan = plan
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # bucket -> graph, out
        self.graph_bytes = 0  # the graphs' memory pool, as measured at capture
        # Passes replayed, run eagerly padded to a bucket, run eagerly as they came (no
        # bucket holds them): tests and benchmarks read them.
        self.replays = 0
        self.padded = 0
        self.unbucketed = 0
        self._static: dict[str, torch.Tensor] = {}  # flat input buffers shared by the graphs
        self._clock = None

    def __call__(self, call: Callable[..., Any], inputs: dict[str, torch.Tensor],
                 loras: Sequence[str | None] | None = None) -> torch.Tensor:
        """`call(loras, **inputs)`'s output (the `field`), through a bucket where one
        fits; `loras` (one per row, or None: the base model) as `LoraSet.forward` takes
        them."""
        ids = inputs["input_ids"]
        rows, width = ids.shape
        bucket = None
        if self.plan.buckets and "attention_mask" in inputs and set(inputs) <= set(INPUTS):
            bucket = bucket_for(rows, width, self.limit, self.max_tokens)
        if bucket is None:
            self.unbucketed += 1
            return _field(call(loras, **inputs), self.field)
        graph = self.graphs.get(bucket)
        if graph is not None and set(inputs) == set(self.inputs) and not any(loras or ()):
            return self._replay(bucket, graph, inputs)
        target = {k: torch.empty(bucket, dtype=v.dtype, device=v.device)
                  for k, v in inputs.items()}
        fill(target, inputs, self.pad_id)
        if loras is not None:
            loras = [*loras, *[None] * (bucket[0] - rows)]
        self.padded += 1
        return sliced(_field(call(loras, **target), self.field), rows, width)

    def _views(self, bucket: tuple[int, int]) -> dict[str, torch.Tensor]:
        size = bucket[0] * bucket[1]
        return {k: self._static[k][:size].view(bucket) for k in self.inputs}

    def _replay(self, bucket: tuple[int, int], graph: tuple[Any, torch.Tensor],
                inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, width = inputs["input_ids"].shape
        fill(self._views(bucket), inputs, self.pad_id)
        cuda_graph, output = graph
        self._clock.enter()
        try:
            cuda_graph.replay()
        finally:
            self._clock.exit()
        self.replays += 1
        return sliced(output, rows, width)

    # --- capture (CUDA only) ------------------------------------------------------------

    def capture(self, model: torch.nn.Module, name: str) -> None:
        """Warm up and capture a graph per bucket of `model` (on CUDA; a no-op unless the
        plan says graphs). A failure logs a warning and leaves the model eager."""
        if not (self.plan.graphs and self.device.startswith("cuda")
                and torch.cuda.is_available()):
            return
        try:
            with torch.inference_mode():
                self._capture(model, name)
        except Exception:
            log.warning("CUDA graphs for %s could not be captured; its passes run eagerly "
                        "(bucketed)", name, exc_info=True)
            self.graphs.clear()
            self._static.clear()
            self.graph_bytes = 0

    def drop_graphs(self) -> None:
        """Forget the captured graphs and their static buffers (their memory pool goes with
        them): the model's tensors are moving off the device (`runtimes.pytorch.offload`),
        and a graph replays the addresses it was captured at. `capture` makes them again."""
        self.graphs.clear()
        self._static.clear()
        self.graph_bytes = 0

    def _capture(self, model: torch.nn.Module, name: str) -> None:
        device = torch.device(self.device)
        buckets = sorted(all_buckets(self.limit, self.max_tokens),
                         key=lambda b: (b[0] * b[1], b[0]), reverse=True)
        if not buckets:
            return
        started = time.perf_counter()
        largest = max(r * w for r, w in buckets)
        self._static = {k: torch.full((largest,), self.pad_id if k == "input_ids" else 0,
                                      dtype=torch.long, device=device) for k in self.inputs}
        sizes: dict[tuple[int, int], torch.Size] = {}
        dtype = torch.float32
        # Warm-up, eager, on this thread's current stream (the memory it leaves cached is
        # then the serving passes' to reuse): kernel choices, workspaces, output shapes.
        for bucket in buckets:
            views = self._views(bucket)
            views["attention_mask"][:, 0] = 1
            output = _field(model(**views), self.field)
            sizes[bucket], dtype = output.shape, output.dtype
            del output
        torch.cuda.current_stream(device).synchronize()
        warmed = time.perf_counter()
        out = torch.empty(max(math.prod(s) for s in sizes.values()), dtype=dtype,
                          device=device)
        reserved = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)  # a capture cannot run on the default stream
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            # One eager pass on the capture's own stream first: what a library sets up per
            # stream (cuBLAS workspaces) is then not set up inside a capture.
            model(**self._views(buckets[-1]))
            side.synchronize()
            for bucket in buckets:
                views = self._views(bucket)
                target = out[:math.prod(sizes[bucket])].view(sizes[bucket])
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    target.copy_(_field(model(**views), self.field))
                finally:
                    graph.capture_end()
                self.graphs[bucket] = (graph, target)
        side.synchronize()
        self.graph_bytes = max(0, torch.cuda.memory_reserved(device) - reserved)
        self._clock = device_clock(device)
        buffers = out.numel() * out.element_size() + len(self.inputs) * largest * 8
        log.info("captured %d CUDA graphs for %s (rows up to %d, widths %s, up to %d padded "
                 "tokens) in %.2fs (warm-up %.2fs): %.1f MiB of graph pool + %.1f MiB of "
                 "static buffers", len(self.graphs), name, max(r for r, _ in buckets),
                 "/".join(map(str, widths(self.limit))), self.max_tokens,
                 time.perf_counter() - started, warmed - started,
                 self.graph_bytes / 2**20, buffers / 2**20)


def _field(output: Any, field: str) -> torch.Tensor:
    return getattr(output, field)


_runners: weakref.WeakKeyDictionary[torch.nn.Module, Buckets] = weakref.WeakKeyDictionary()


def install(model: torch.nn.Module, *, field: str, device: str, pad_id: int, limit: int,
            max_tokens: int, inputs: Sequence[str], name: str,
            replaced_forward: bool = False) -> Buckets | None:
    """Give `model` its buckets (None, and nothing done, when SHOAL_CUDA_GRAPHS says
    neither buckets nor graphs for it) and capture its graphs where the plan says so."""
    wanted = plan(configured_mode(), device, replaced_forward)
    if not wanted.buckets:
        _runners.pop(model, None)
        return None
    runner = Buckets(field=field, device=device, pad_id=pad_id, limit=limit,
                     max_tokens=max_tokens, inputs=inputs, plan=wanted)
    runner.capture(model, name)
    _runners[model] = runner
    return runner


def buckets_of(model: torch.nn.Module) -> Buckets | None:
    return _runners.get(model)


def forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor], field: str,
            loras: Sequence[str | None] | None = None, lora_set: Any = None) -> torch.Tensor:
    """The `field` output of `model` for `inputs`: what every encoder family's pass calls.
    Through the model's buckets (and graphs) where it has them, else `model(**inputs)`
    as it is. With a `lora_set` (the `runtimes.pytorch.lora.LoraSet` on `model`), eager
    passes are `lora_set.forward(loras, **inputs)`, row i with LoRA `loras[i]`."""
    runner = _runners.get(model)
    if runner is None or runner.field != field:
        output = model(**inputs) if lora_set is None else lora_set.forward(loras, **inputs)
        return _field(output, field)
    if lora_set is None:
        return runner(lambda _, **x: model(**x), inputs)
    return runner(lora_set.forward, inputs, loras)


def graph_bytes(obj: Any, depth: int = 2) -> int:
    """The CUDA graph memory of the models `obj` holds (itself, or in its attributes,
    `depth` levels deep)."""
    found: dict[int, Buckets] = {}
    _find(obj, depth, found, set())
    return sum(r.graph_bytes for r in found.values())


def _find(obj: Any, depth: int, found: dict[int, Buckets], seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        runner = _runners.get(obj)
        if runner is not None:
            found[id(runner)] = runner
        return
    if depth > 0 and hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            _find(value, depth - 1, found, seen)
