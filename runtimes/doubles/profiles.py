"""What an emulated device takes for a forward pass: its profiles, and the setting that picks one.

`SHOAL_EMULATE_DEVICE=<profile>` names one of `PROFILES` (e.g. `h100/minilm`) or gives
explicit `fixed_ms,per_token_us` (e.g. `0.25,0.2`); `runtimes.doubles.emulated` runs the
forward passes of the profile it picks,

    fixed_ms + per_token_us x padded tokens  (padded tokens = rows x columns of input_ids)

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

import math
import os
from dataclasses import dataclass
from functools import lru_cache

ENV = "SHOAL_EMULATE_DEVICE"  # read when the PyTorch engine starts and a model loads
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
