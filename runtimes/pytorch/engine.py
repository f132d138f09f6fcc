"""What the model host asks of PyTorch: the adapter class of an entry, its number format,
the device's memory and clock, and freeing memory after an unload."""

from __future__ import annotations

from typing import Any

import torch

from runtimes.child_side.adapter import Adapter
from runtimes.model_files.footprint import physical_memory_bytes, tensor_bytes
from runtimes.model_files.precision import resolve_precision
from runtimes.pytorch import device_seam, offload
from runtimes.pytorch.buckets import graph_bytes
from runtimes.pytorch.device_time import device_clock
from runtimes.pytorch.families import ADAPTERS
from tasks.catalog import ModelEntry
from tasks.engines import resolve


class TorchEngine:
    name = "pytorch"
    adapters = ADAPTERS

    def __init__(self, device: str, threads: int = 0,
                 seam: device_seam.DeviceSeam | None = None) -> None:
        """`seam`: where the forward path's passes queue and the host waits for them
        (`runtimes.pytorch.device_seam`); None: what the process's settings say (the real
        device, or a stand-in a benchmark's setting asks for)."""
        self.device = device
        if threads > 0:
            torch.set_num_threads(threads)
        self.clock = device_clock(device)
        if seam is not None:
            device_seam.install(seam)
        self.seam = device_seam.configured()

    def adapter_class(self, entry: ModelEntry) -> type[Adapter]:
        """The class of the entry's family (imported only when needed)."""
        return resolve(self.adapters[entry.adapter])

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
            # Pinned host memory freed by the host-memory tier stays cached by torch's
            # host allocator until emptied (a private call, in torch >= 2.5 CUDA builds).
            empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
            if empty_host_cache is not None:
                empty_host_cache()

    def offload(self, adapter: Adapter, budget: int) -> int | None:
        """An unloaded model kept in host memory (`runtimes.child_side.host_tier`): on CUDA
        its tensors move to pinned host memory (`runtimes.pytorch.offload`); on a CPU
        nothing moves. The host bytes it then takes; None (nothing moved) when its
        tensors are more than `budget`."""
        if tensor_bytes(adapter) > budget:
            return None
        if not self.device.startswith("cuda"):
            return tensor_bytes(adapter)
        return offload.to_host(adapter)

    def restore(self, adapter: Adapter) -> None:
        """A kept model back on the device, as it was (`offload` reversed)."""
        if self.device.startswith("cuda"):
            offload.to_device(adapter, self.device, adapter.entry.id)

    def total_bytes(self) -> int:
        if self.device.startswith("cuda"):
            return int(torch.cuda.get_device_properties(torch.device(self.device)).total_memory)
        return physical_memory_bytes()

    def stamp(self) -> dict[str, Any] | None:
        return device_seam.current().stamp()

    def warm(self) -> None:
        """A spare runs a few tiny CPU ops of the kinds encoders run: the first of each sets
        up torch's thread pool and kernels (part of the ~0.2 s a fresh process's first batch
        takes more than its second). On the main thread: the pool's threads inherit its
        normal priority. No device op: no CUDA context."""
        with torch.inference_mode():
            x = torch.randn(2, 8, 32)
            y = torch.nn.functional.gelu(torch.nn.functional.linear(x, torch.randn(32, 32)))
            y = torch.nn.functional.layer_norm(y, (32,))
            torch.nn.functional.scaled_dot_product_attention(y[:, None], y[:, None], y[:, None])
            torch.softmax(y @ y.transpose(1, 2), dim=-1).sum()
