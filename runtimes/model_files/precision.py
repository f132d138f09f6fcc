"""The number format a model computes in on its device: fp32, fp16 or bf16.

A catalog profile may name one (`precision:`); else the device decides: bf16 on a
CUDA device that supports it (same range as fp32, so no overflow in long sums), else
fp16 on CUDA, and fp32 on CPU, where PyTorch's half-precision kernels are slow. The
worker's SHOAL_PRECISION overrides both for every model it serves. Half precision is
for the forward pass only: adapters turn outputs into float32 before results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.precision import PRECISIONS, Precision

if TYPE_CHECKING:
    import torch

    from tasks.catalog import BatchProfile, ModelEntry


def device_kind(device: str) -> str:
    """The profile key of a torch device: 'cuda:1' -> 'cuda'."""
    return device.split(":", 1)[0].strip().lower()


def profile_on(entry: ModelEntry, device: str) -> BatchProfile | None:
    """The entry's tuned profile for `device`, by its name ('cuda:1') or its kind
    ('cuda'); None where it has neither."""
    return entry.profile(device) or entry.profile(device_kind(device))


def default_precision(device: str) -> Precision:
    if device_kind(device) != "cuda":
        return "fp32"
    import torch

    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def resolve_precision(entry: ModelEntry, device: str, override: str | None = None,
                      profile: str | None = None) -> Precision:
    """What `entry` runs in on `device`: the override, else the profile's (the profile of
    name `profile`, else of the device's kind), else the device's default."""
    if override:
        if override not in PRECISIONS:
            raise ValueError(f"precision {override!r} is none of {list(PRECISIONS)}")
        return override  # type: ignore[return-value]
    tuned = entry.profile(profile or device_kind(device))
    # A profile's format may be another engine's (int8: the ONNX Runtime its profile
    # chose); PyTorch serving the model then (SHOAL_RUNTIME=pytorch) uses its default.
    if tuned is not None and tuned.precision in PRECISIONS:
        return tuned.precision  # type: ignore[return-value]
    return default_precision(device)


def torch_dtype(precision: str) -> torch.dtype:
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
