"""The number formats a model may compute in (the catalog's `precision`), without torch."""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "fp16", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "bf16")
# PyTorch's fp16 kernels on CPUs are slow and some are missing; bf16 has CPU kernels
# (AMX/AVX-512 BF16 where the CPU has them) and fp32's range.
CPU_PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
