"""The number formats a model may compute in (the catalog's `precision`), without torch."""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "fp16", "bf16", "int8"]
# PyTorch's formats (runtimes.model_files.precision).
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "bf16")
# PyTorch's fp16 kernels on CPUs are slow and some are missing; bf16 has CPU kernels
# (AMX/AVX-512 BF16 where the CPU has them) and fp32's range.
CPU_PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
# ONNX Runtime's (runtimes.onnx): int8 is a dynamically quantized graph (weights int8,
# activations quantized per batch), made by `shoal export --precision int8`; fp16 is for
# CUDA, where its CPU kernels are few.
ONNX_PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "int8")
ONNX_CPU_PRECISIONS: tuple[Precision, ...] = ("fp32", "int8")


def precisions_of(runtime: str) -> tuple[Precision, ...]:
    """The formats a runtime computes in (SGLang takes PyTorch's)."""
    return ONNX_PRECISIONS if runtime == "onnx" else PRECISIONS


def cpu_precisions_of(runtime: str) -> tuple[Precision, ...]:
    return ONNX_CPU_PRECISIONS if runtime == "onnx" else CPU_PRECISIONS
