"""An emulated device, for benchmarks only: the real CPU path, the forward replaced by a wait.

`SHOAL_EMULATE_DEVICE=<profile>` (a name of `PROFILES`, e.g. `h100/minilm`, or explicit
`fixed_ms,per_token_us`, e.g. `0.25,0.2`) in a runtime process's environment (a worker's
runtime inherits the worker's: `SHOAL_EMULATE_DEVICE=h100/minilm shoal worker`) makes
`load_model` hand every model it loads to `emulate_forward`: the model is loaded and
watched as usual, and every CPU step of its adapter runs for real (decode, parse,
tokenize, pad, pool, results, the frames to and from the worker); only the model's own
forward is replaced by a wait of what the profile says the device would take,

    fixed_ms + per_token_us x padded tokens  (padded tokens = rows x columns of input_ids)

returning zeros of the shape and dtype the adapter reads (viewed from a cached buffer, so
a pass allocates nothing that grows with it). The wait sleeps until a `perf_counter`
deadline, never less, and `time.sleep` releases the GIL: like a GPU, the "device" leaves
the CPU to the other threads while it computes. The device clock (`device_time`) counts
the time asked, not how late the wait woke up (on a busy host, the scheduler and the
GIL held by the runtime's other threads wake it up to milliseconds late: the host's delay,
not the device's, which CUDA events would not count either), so `batch.device_ms` and
`shoal_device_busy_seconds_total` read as on a device of the profile's speed.

The device is a queue, as a CUDA stream is: a pass starts when the one before it ends
(or when it is called, if later). Inside `queued_passes()` a pass returns at once and the
host waits for it where it reads the outputs (`wait_queued`, called by
`runtimes.pytorch.text.HostCopy`, the pipelined dense adapter's copy to the host); so a
host thread that wakes late from one batch's wait does not idle the device when the next
batch was already queued behind it, as on a GPU. Outside it (the other families, which
read their outputs at once) a pass waits until its own end. This is
what DESIGN.md "Feeding the device" asks for: on a machine without a GPU, does the CPU
side keep a device of a given speed busy, and how many cores does that take
(`bench/device_feed.py` measures it).

Results are zeros, not the model's: a process that emulates logs a WARNING per model and
`emulation_stamp()` says so (the host marks the results `simulated` with it). Families it
emulates: text encoders loaded as AutoModel (dense, multivector), AutoModelForMaskedLM
(sparse), AutoModelForSequenceClassification (cross-encoder, sequence-classification,
zero-shot) and AutoModelForTokenClassification; anything else (causal LMs, CLIP) fails
its load with a ValueError that says so. It emulates on the CPU path only: on CUDA the
device clock times kernels, and a wait launches none.

Profiles. `h200-measured/*` are the least-squares fits of device time per batch that
`bench/gpu_check.py` measured on an H200 in bf16 (BENCHMARKS.md, "On a GPU", commit
7fd84d0): eager PyTorch, launch-bound, so the fixed part is ~3-5 ms of kernel-launch gaps.
The L4-, A100- and H100-class profiles are derived from datasheet figures (`GPUS`), the
models' shapes (`ENCODERS`) and three stated assumptions (`derive`): a forward whose
kernels are launched back to back (CUDA graphs or a compiled engine, as TEI or TensorRT
run them, not eager PyTorch), 35% of the dense bf16 tensor peak on the encoder's GEMMs,
and 70% of the memory bandwidth to read the weights once per batch.

Issue 26 quotes an H100-class MiniLM profile of 0.25 ms + 0.2 us per padded token. The
fixed part agrees with `derive` (6 layers x 10 kernels x 4 us of launches + 21 MB of
weights at 70% of 3.35 TB/s = 0.249 ms). The per-token part does not: MiniLM costs 22.4
MFLOP per token, so 0.2 us per token is 112 TFLOP/s, 11% of an H100's 989 (or an
A100-class device at 35%), where `h100/minilm` assumes 35% (0.065 us per token, the
marginal cost the H200 run measured: same Hopper tensor cores). The issue's figures are
kept as `h100-conservative/minilm`, a device three times slower per token.
"""

from __future__ import annotations

import fcntl
import logging
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from runtimes.base import EMULATED_QUEUE_ENV
from runtimes.pytorch.device_time import DeviceClock, device_clock

log = logging.getLogger(__name__)

ENV = "SHOAL_EMULATE_DEVICE"
_OFF = frozenset({"", "0", "off", "false", "no", "none"})


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """How long an emulated device takes for a forward pass, and where that comes from."""

    name: str
    fixed_ms: float
    per_token_us: float
    source: str

    def seconds(self, padded_tokens: int) -> float:
        """The device time of one forward pass over `padded_tokens` (rows x columns)."""
        return self.fixed_ms / 1e3 + self.per_token_us / 1e6 * padded_tokens


# --- published figures and the assumptions the derived profiles rest on ----------------------


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU's datasheet figures: dense (not 2:4-sparse) bf16/fp16 tensor throughput."""

    name: str
    bf16_tflops: float
    memory_tb_s: float
    source: str


GPUS: dict[str, Gpu] = {g.name: g for g in (
    # NVIDIA L4 Tensor Core GPU datasheet: FP16/BF16 Tensor Core 242 TFLOPS "with sparsity"
    # (121 dense), GPU memory bandwidth 300 GB/s.
    Gpu("l4", 121.0, 0.300, "NVIDIA L4 datasheet: 242 TFLOPS bf16 with sparsity (121 dense), "
        "300 GB/s"),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16 Tensor Core 312 TFLOPS
    # (624 with sparsity), GPU memory bandwidth 2,039 GB/s.
    Gpu("a100", 312.0, 2.039, "NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, "
        "2,039 GB/s"),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 Tensor Core 1,979 TFLOPS with
    # sparsity (989 dense), GPU memory bandwidth 3.35 TB/s.
    Gpu("h100", 989.0, 3.35, "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with sparsity "
        "(989 dense), 3.35 TB/s"),
)}


@dataclass(frozen=True, slots=True)
class Encoder:
    """A BERT-shaped encoder: what its forward computes and reads per token and per pass."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    source: str

    @property
    def linear_params(self) -> int:
        """Weights of the GEMMs: Q, K, V, output projection, and the two FFN matrices."""
        return self.layers * (4 * self.hidden * self.hidden + 2 * self.hidden * self.intermediate)

    def flops_per_token(self, sequence: int = 128) -> float:
        """2 FLOPs per weight per token, plus attention's QK^T and AV at `sequence` tokens."""
        return 2 * self.linear_params + 4 * sequence * self.hidden * self.layers

    @property
    def weight_bytes(self) -> int:
        """The GEMM weights in bf16, read once per forward pass (the embedding table is
        gathered, a row per token, not read whole)."""
        return 2 * self.linear_params


ENCODERS: dict[str, Encoder] = {e.name: e for e in (
    # config.json of sentence-transformers/all-MiniLM-L6-v2: 6 layers, hidden 384, FFN 1536;
    # 10.6 M GEMM weights, 22.4 MFLOP per token at 128 tokens.
    Encoder("minilm", 6, 384, 1536, "all-MiniLM-L6-v2 config: 6 x 384 (FFN 1536)"),
    # config.json of BAAI/bge-base-en-v1.5 (BERT-base): 12 layers, hidden 768, FFN 3072;
    # 84.9 M GEMM weights, 174.6 MFLOP per token at 128 tokens.
    Encoder("bge-base", 12, 768, 3072, "bge-base-en-v1.5 config: 12 x 768 (FFN 3072)"),
)}

# ASSUMPTIONS of the derived profiles (not measurements):
# - the GEMMs reach 35% of the dense bf16 peak. Calibration: the H200 run's marginal cost
#   of MiniLM in bf16, 0.0644 us per padded token, is 22.4 MFLOP / 0.0644 us = 348 TFLOP/s,
#   35% of the H200's 989 (the H100's tensor cores). (bge-base's fit, 0.211 us, would be
#   84%: in a launch-bound forward part of the compute hides in the launch gaps, so a fit's
#   slope understates the per-token cost of a bigger model; 35% is used for both.)
COMPUTE_UTILISATION = 0.35
# - the weights stream once per pass at 70% of the datasheet bandwidth;
MEMORY_UTILISATION = 0.70
# - the kernels are launched back to back (CUDA graphs, a compiled engine): ~10 kernels per
#   layer (QKV, attention, output projection, two add+layernorms, FFN up, activation, FFN
#   down, and the odd copy), each ~4 us from launch to launch when small. Eager PyTorch
#   takes far longer (the h200-measured profiles: 2.9 ms for MiniLM's 6 layers).
KERNELS_PER_LAYER = 10
LAUNCH_US = 4.0


def derive(gpu: Gpu, encoder: Encoder) -> DeviceProfile:
    """The profile of `encoder` on `gpu` under the assumptions above:
    fixed = launches + weights / bandwidth; per token = FLOPs / achieved throughput."""
    launches_ms = encoder.layers * KERNELS_PER_LAYER * LAUNCH_US / 1e3
    weights_ms = encoder.weight_bytes / (gpu.memory_tb_s * 1e12 * MEMORY_UTILISATION) * 1e3
    per_token_us = encoder.flops_per_token() / (gpu.bf16_tflops * 1e12 * COMPUTE_UTILISATION) * 1e6
    return DeviceProfile(
        f"{gpu.name}/{encoder.name}", round(launches_ms + weights_ms, 4), round(per_token_us, 4),
        f"derived: {gpu.source}; {encoder.source}, {encoder.flops_per_token() / 1e6:.1f} MFLOP "
        f"per token at {COMPUTE_UTILISATION:.0%} of peak; {encoder.weight_bytes / 1e6:.0f} MB "
        f"of bf16 weights at {MEMORY_UTILISATION:.0%} of bandwidth; {KERNELS_PER_LAYER} "
        f"kernels per layer launched {LAUNCH_US:g} us apart",
    )


_MEASURED = "BENCHMARKS.md 'On a GPU' (bench/gpu_check.py, commit 7fd84d0): H200, bf16, " \
            "eager PyTorch, least-squares device time per batch"

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile("h200-measured/minilm", 2.899, 0.0644, f"{_MEASURED}, all-MiniLM-L6-v2"),
    DeviceProfile("h200-measured/bge-small", 4.418, 0.0810, f"{_MEASURED}, bge-small's shape"),
    DeviceProfile("h200-measured/bge-base", 4.835, 0.2111, f"{_MEASURED}, bge-base's shape"),
    *(derive(gpu, encoder) for gpu in GPUS.values() for encoder in ENCODERS.values()),
    # Issue 38's device for "can the host feed it": MiniLM on an H100-class GPU with the
    # launch gaps gone (CUDA graphs), the H200 bf16 fit's slope and a fixed part of one
    # graph replay plus the copies.
    DeviceProfile("h100-graphs/minilm", 0.3, 0.0644,
                  "issue 38: H100-class MiniLM without launch gaps: 0.3 ms per batch + the "
                  "H200 bf16 fit's 0.0644 us per padded token"),
    DeviceProfile("h100-conservative/minilm", 0.25, 0.2,
                  "issue 26's H100-class MiniLM profile: 0.25 ms + 0.2 us per padded token "
                  "(11% of the H100's dense bf16 peak; see the module doc)"),
)}


@lru_cache(maxsize=16)
def parse_profile(value: str) -> DeviceProfile | None:
    """The profile a SHOAL_EMULATE_DEVICE value names (None: emulation off); ValueError for
    a value that is neither a profile's name nor `fixed_ms,per_token_us`."""
    text = value.strip().lower()
    if text in _OFF:
        return None
    if text in PROFILES:
        return PROFILES[text]
    parts = text.split(",")
    if len(parts) == 2:
        try:
            fixed_ms, per_token_us = (float(p) for p in parts)
        except ValueError:
            pass
        else:
            if not all(math.isfinite(v) and v >= 0 for v in (fixed_ms, per_token_us)):
                raise ValueError(f"{ENV}={value!r}: fixed_ms and per_token_us must be finite "
                                 "and >= 0")
            return DeviceProfile(f"explicit/{fixed_ms:g},{per_token_us:g}", fixed_ms,
                                 per_token_us, f"{ENV}={value}")
    raise ValueError(f"{ENV}={value!r} is neither a profile ({', '.join(PROFILES)}) nor "
                     "'fixed_ms,per_token_us' (e.g. '0.25,0.2')")


def configured_profile() -> DeviceProfile | None:
    """The profile this process's environment asks for (None: emulation off)."""
    return parse_profile(os.environ.get(ENV, ""))


# --- what the emulated passes asked for and waited --------------------------------------------


@dataclass(frozen=True, slots=True)
class EmulatedTotals:
    """Emulated forward passes of this process, summed (see `totals`)."""

    passes: int = 0
    padded_tokens: int = 0
    requested_s: float = 0.0  # what the profile asked the passes to take
    waited_s: float = 0.0  # how long after their call they ended (queue + pass + late)


_totals = EmulatedTotals()
_totals_lock = threading.Lock()
_loaded: DeviceProfile | None = None  # the profile of the last model emulated here


def totals() -> EmulatedTotals:
    return _totals


def reset() -> None:
    """Zero the totals and forget the models emulated so far (tests: the next load decides)."""
    global _totals, _loaded, _stream
    with _totals_lock:
        _totals = EmulatedTotals()
        _loaded = None
        _stream = _make_stream()


def _count(tokens: int, requested_s: float, waited_s: float) -> None:
    global _totals
    with _totals_lock:
        t = _totals
        _totals = EmulatedTotals(t.passes + 1, t.padded_tokens + tokens,
                                 t.requested_s + requested_s, t.waited_s + waited_s)


def emulation_stamp() -> dict[str, Any] | None:
    """What to mark this process's results with while its models run on an emulated device
    (the profile and its constants; `device` is what the gateway's X-Simulated header
    shows), or None when nothing here is emulated: neither a model loaded emulated nor
    SHOAL_EMULATE_DEVICE set."""
    profile = _loaded or configured_profile()
    if profile is None:
        return None
    return {"device": f"emulated:{profile.name}", "emulated": True, "profile": profile.name,
            "fixed_ms": profile.fixed_ms, "per_token_us": profile.per_token_us,
            "source": profile.source}


def wait_until(deadline: float) -> None:
    """Sleep (GIL released) until `time.perf_counter()` reaches `deadline`; never less."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


class _Stream:
    """The emulated device's queue of passes: when it is free again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def queue(self, called: float, seconds: float) -> float:
        """Queue a pass of `seconds` called at `called`; when it ends."""
        with self._lock:
            self._free_at = max(called, self._free_at) + seconds
            return self._free_at


class _SharedStream:
    """`_Stream` in a file that several processes map: the replicas of one device
    (`runtimes.worker_side.replicas`) queue their passes on one emulated device, as their kernels
    would on one GPU. perf_counter is CLOCK_MONOTONIC on Linux: one clock for all."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < _FREE_AT.size:
            os.ftruncate(self._fd, _FREE_AT.size)  # zeros: free since the epoch
        self._map = mmap.mmap(self._fd, _FREE_AT.size)

    def queue(self, called: float, seconds: float) -> float:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                (free_at,) = _FREE_AT.unpack_from(self._map)
                free_at = max(called, free_at) + seconds
                _FREE_AT.pack_into(self._map, 0, free_at)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            return free_at


_FREE_AT = struct.Struct("d")


def _make_stream() -> _Stream | _SharedStream:
    path = os.environ.get(EMULATED_QUEUE_ENV)
    return _SharedStream(path) if path else _Stream()


_stream = _make_stream()
_queued = threading.local()  # per thread: inside queued_passes, and the last queued end


@contextmanager
def queued_passes() -> Iterator[None]:
    """Emulated passes called inside return at once, queued on the device (see the module
    doc); `wait_queued()` waits for the last of them. Without an emulated model, nothing."""
    _queued.depth = getattr(_queued, "depth", 0) + 1
    try:
        yield
    finally:
        _queued.depth -= 1


def queued_until() -> float | None:
    """When the passes this thread queued since the last call end (None: it queued none)."""
    until, _queued.until = getattr(_queued, "until", None), None
    return until


def wait_queued(until: float | None) -> None:
    """Wait (GIL released) until the passes of `queued_until()` have run."""
    if until is not None:
        wait_until(until)


# --- the forward ------------------------------------------------------------------------------


class EmulatedForward:
    """A model's forward on the emulated device: zeros of the right shape after a wait.

    `kind` is what the adapter reads: "hidden" (last_hidden_state, rows x columns x width),
    "token_logits" (rows x columns x width) or "sequence_logits" (rows x width)."""

    _OUTPUTS = {"hidden": BaseModelOutput, "token_logits": MaskedLMOutput,
                "sequence_logits": SequenceClassifierOutput}

    def __init__(self, profile: DeviceProfile, kind: str, width: int, dtype: torch.dtype,
                 output_class: type | None = None) -> None:
        self.profile = profile
        self.kind = kind
        self.width = width
        self.dtype = dtype
        self.output_class = output_class or self._OUTPUTS[kind]
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._unbilled = threading.local()  # per thread: see unbilled_s

    def _zeros(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A view of `shape` on a zero buffer that grows (by doubling) and is then reused."""
        size = math.prod(shape)
        with self._lock:
            buffer = self._buffers.get(device)
            if buffer is None or buffer.numel() < size:
                grown = max(size, 2 * (0 if buffer is None else buffer.numel()))
                with torch.inference_mode(False):
                    buffer = self._buffers[device] = torch.zeros(grown, dtype=self.dtype,
                                                                 device=device)
        return buffer[:size].view(shape)

    def __call__(self, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if input_ids is None:
            raise ValueError("the emulated device takes input_ids (rows x columns)")
        rows, columns = input_ids.shape
        tokens = rows * columns
        requested = self.profile.seconds(tokens)
        if self.kind == "sequence_logits":
            out = self.output_class(logits=self._zeros((rows, self.width), input_ids.device))
        elif self.kind == "hidden":
            out = self.output_class(
                last_hidden_state=self._zeros((rows, columns, self.width), input_ids.device))
        else:
            out = self.output_class(
                logits=self._zeros((rows, columns, self.width), input_ids.device))
        # The output is made inside the pass's time, not after it: the wait is what the
        # device takes, whatever making zeros costs (as long as that is less).
        ends = _stream.queue(started, requested)
        if getattr(_queued, "depth", 0):
            _queued.until = ends
        else:
            wait_until(ends)
        returned = time.perf_counter()
        # The device clock timed this call from about `started` to `returned`.
        self._unbilled.seconds = requested - (returned - started)
        _count(tokens, requested, max(returned, ends) - started)
        return out

    def unbilled_s(self) -> float:
        """What the device clock must add to its time of this thread's last pass to bill
        the time asked (negative: a wait that woke late, or a pass queued behind another;
        positive: a queued pass that returned at once). 0 once read."""
        unbilled = getattr(self._unbilled, "seconds", 0.0)
        self._unbilled.seconds = 0.0
        return unbilled


def _text_encoder(config: Any) -> bool:
    """A config of a plain text encoder (BERT-like): no vision tower, no decoder."""
    return (not getattr(config, "is_encoder_decoder", False)
            and not getattr(config, "is_decoder", False)
            and not any(hasattr(config, k) for k in ("vision_config", "text_config"))
            and not any(a.endswith(("CausalLM", "ForConditionalGeneration"))
                        for a in getattr(config, "architectures", None) or ())
            and isinstance(getattr(config, "hidden_size", None), int))


SUPPORTED = ("AutoModel text encoders (dense, multivector), AutoModelForMaskedLM (sparse), "
             "AutoModelForSequenceClassification (cross-encoder, sequence-classification, "
             "zero-shot), AutoModelForTokenClassification (token-classification)")


def _forward_for(model: torch.nn.Module, model_class: Any, ref: str,
                 profile: DeviceProfile) -> EmulatedForward:
    config = model.config
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    if model_class is AutoModel and _text_encoder(config):
        return EmulatedForward(profile, "hidden", int(config.hidden_size), dtype)
    if model_class is AutoModelForMaskedLM:
        return EmulatedForward(profile, "token_logits", int(config.vocab_size), dtype)
    if model_class is AutoModelForTokenClassification:
        return EmulatedForward(profile, "token_logits", int(config.num_labels), dtype,
                               TokenClassifierOutput)
    if model_class is AutoModelForSequenceClassification:
        return EmulatedForward(profile, "sequence_logits", int(config.num_labels), dtype)
    raise ValueError(
        f"{ENV}={profile.name}: the emulated device cannot emulate {ref}, loaded as "
        f"{getattr(model_class, '__name__', model_class)} ({type(model).__name__}); it emulates "
        f"{SUPPORTED} (not causal-lm or clip). Unset {ENV} to serve it on the real model.")


def emulate_forward(model: torch.nn.Module, model_class: Any, ref: str) -> DeviceProfile | None:
    """Replace `model`'s forward by the emulated device's when SHOAL_EMULATE_DEVICE is set
    (the profile; None, the model untouched, when it is not). Called by `load_model` after
    the device clock is attached: the clock's hooks run around `model(...)`, which calls
    the instance's `forward`, so the wait counts as device time.

    ValueError (the load fails) for a family it cannot emulate, or a model not on the CPU."""
    global _loaded
    profile = configured_profile()
    if profile is None:
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu":
        raise ValueError(f"{ENV}={profile.name}: the emulated device runs on the CPU path "
                         f"(SHOAL_DEVICE=cpu); {ref} is on {device}, whose clock times kernels")
    forward = _forward_for(model, model_class, ref, profile)
    model.forward = forward  # an instance attribute: nn.Module.__call__ runs it, hooks and all
    clock = device_clock(device)
    # After the clock's own hook (hooks run in the order registered): the device was busy
    # for the time asked; a wake-up after that (the scheduler, the GIL held by the
    # runtime's other threads) is the host's, as CUDA events would not count it either,
    # and a queued pass that returned at once still took its time.
    model.register_forward_hook(lambda *_: _bill(clock, forward.unbilled_s()))
    _loaded = profile
    if torch.get_num_threads() > 1:
        # What torch still computes here is what a GPU would run after the forward (pooling
        # the zeros): a few kernel launches there. Intra-op threads would only make it
        # contend with the pipeline for the cores (10x slower than one thread on 2 busy
        # cores, measured), billing the CPU side for the device's work.
        log.warning("EMULATED device: torch intra-op threads %d -> 1", torch.get_num_threads())
        torch.set_num_threads(1)
    log.warning("EMULATED device %s: %s computes nothing; each forward pass waits %g ms + "
                "%g us per padded token and returns zeros (%s). Results are not the model's.",
                profile.name, ref, profile.fixed_ms, profile.per_token_us, profile.source)
    return profile


def _bill(clock: DeviceClock, seconds: float) -> None:
    """Add `seconds` (here: what the clock's own timing of a pass missed, or took too
    much) to the busy time `clock` has not yet handed out."""
    clock.bill(seconds)


def emulated_profile(model: torch.nn.Module) -> DeviceProfile | None:
    """The profile `model` runs on when emulated, else None."""
    forward = model.__dict__.get("forward")
    return forward.profile if isinstance(forward, EmulatedForward) else None

