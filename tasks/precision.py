"""The number formats a model may compute in (the catalog's `precision`), without torch.

Which engine computes in which is the registry's (`tasks.engines`, each entry's
`precisions` and `cpu_precisions`).
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "fp16", "bf16", "int8"]
# torch's formats (runtimes.model_files.precision), those of the engines built on it.
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "bf16")
# torch's fp16 kernels on CPUs are slow and some are missing; bf16 has CPU kernels
# (AMX/AVX-512 BF16 where the CPU has them) and fp32's range.
CPU_PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
