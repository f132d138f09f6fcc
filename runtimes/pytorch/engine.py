"""What the model host asks of PyTorch: the adapter class of an entry, its number format,
the device's memory and clock, and freeing memory after an unload."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from runtimes.child_side.adapter import Adapter
from runtimes.model_files.footprint import physical_memory_bytes, tensor_bytes
from runtimes.model_files.precision import resolve_precision
from runtimes.pytorch import device_double
from runtimes.pytorch.buckets import graph_bytes
from runtimes.pytorch.device_time import device_clock
from tasks.catalog import ModelEntry


class TorchEngine:
    name = "pytorch"

    def __init__(self, device: str, threads: int = 0) -> None:
        self.device = device
        if threads > 0:
            torch.set_num_threads(threads)
        self.clock = device_clock(device)
        device_double.configured()  # benchmarks only: SHOAL_EMULATE_DEVICE installs one

    def adapter_class(self, entry: ModelEntry) -> type[Adapter]:
        """The class the entry's family names (imported only when needed)."""
        module, _, name = entry.contract.implementation.partition(":")
        return getattr(importlib.import_module(module), name)

    def precision(self, entry: ModelEntry, override: str | None) -> str:
        return resolve_precision(entry, self.device, override)

    def allocated(self) -> int:
        if self.device.startswith("cuda"):
            return int(torch.cuda.memory_allocated(torch.device(self.device)))
        return 0

    def measure(self, adapter: Adapter, allocated_before: int) -> int:
        """The tensors it holds; on CUDA the allocator also counts what loading left
        behind (rounding, workspaces, graphs' static buffers), unless a concurrent batch
        blurs the delta; plus its CUDA graphs' memory pool (`runtimes.pytorch.buckets`)."""
        return (max(tensor_bytes(adapter), self.allocated() - allocated_before)
                + graph_bytes(adapter))

    def release(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def total_bytes(self) -> int:
        if self.device.startswith("cuda"):
            return int(torch.cuda.get_device_properties(torch.device(self.device)).total_memory)
        return physical_memory_bytes()

    def stamp(self) -> dict[str, Any] | None:
        double = device_double.current()
        return None if double is None else double.stamp()
