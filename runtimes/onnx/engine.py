"""What the model host asks of ONNX Runtime: the adapter class of an entry, its number
format, the memory a model takes and the device's clock. No torch here, nor below."""

from __future__ import annotations

import subprocess
from typing import Any

from runtimes.child_side.adapter import Adapter
from runtimes.model_files.footprint import physical_memory_bytes
from runtimes.model_files.precision import device_kind
from runtimes.onnx.adapter import OnnxAdapter
from runtimes.onnx.session import SessionClock
from tasks.catalog import ModelEntry
from tasks.engines import engine, resolve

# Catalog adapter -> "module:class" (imported when an entry of it loads); the registry's
# `families` of onnx (tasks.engines) are its keys.
ADAPTERS = {
    "dense": "runtimes.onnx.dense:OnnxDenseAdapter",
    "sparse": "runtimes.onnx.sparse:OnnxSparseAdapter",
    "cross-encoder": "runtimes.onnx.classify:OnnxCrossEncoderAdapter",
    "sequence-classification": "runtimes.onnx.classify:OnnxSequenceClassificationAdapter",
    "zero-shot": "runtimes.onnx.classify:OnnxZeroShotAdapter",
    "token-classification": "runtimes.onnx.tokens:OnnxTokenClassificationAdapter",
}


class OnnxEngine:
    name = "onnx"
    adapters = ADAPTERS

    def __init__(self, device: str, threads: int = 0) -> None:
        self.device = device
        self.threads = threads
        self.clock = SessionClock()

    def adapter_class(self, entry: ModelEntry) -> type[Adapter]:
        """The entry's ONNX adapter, bound to this engine's threads and clock."""
        path = self.adapters.get(entry.adapter)
        if path is None:
            raise ValueError(f"{entry.id}: the ONNX runtime serves {sorted(self.adapters)}, "
                             f"not {entry.adapter!r}; say runtime: pytorch")
        base: type[OnnxAdapter] = resolve(path)
        return type(base.__name__, (base,), {"threads": self.threads, "clock": self.clock})

    def precision(self, entry: ModelEntry, override: str | None) -> str:
        """The override, else the profile's when ONNX Runtime computes in it, else fp16 on
        CUDA and fp32 on CPU (int8 is asked for: it changes results a little)."""
        cpu = device_kind(self.device) != "cuda"
        registered = engine(self.name)
        allowed = registered.cpu_precisions if cpu else registered.precisions
        if override:
            if override not in allowed:
                raise ValueError(f"precision {override!r}: the ONNX runtime computes in "
                                 f"{list(allowed)} on {self.device}")
            return override
        tuned = entry.profile(device_kind(self.device))
        if tuned is not None and tuned.precision in allowed:
            return tuned.precision
        return "fp32" if cpu else "fp16"

    def allocated(self) -> int:
        return 0

    def measure(self, adapter: Adapter, allocated_before: int) -> int:
        assert isinstance(adapter, OnnxAdapter)
        return adapter.graph_bytes

    def release(self) -> None:
        pass

    def offload(self, adapter: Adapter, budget: int) -> int | None:
        """An unloaded model kept in host memory (`runtimes.child_side.host_tier`): on a CPU
        its session stays as it is (the saving is the session's build); a session on a GPU
        cannot move, so it is not kept (None), nor is one of more than `budget` bytes."""
        assert isinstance(adapter, OnnxAdapter)
        if device_kind(self.device) == "cuda" or adapter.graph_bytes > budget:
            return None
        return adapter.graph_bytes

    def restore(self, adapter: Adapter) -> None:
        pass  # kept on a CPU only, where it never left

    def total_bytes(self) -> int:
        if device_kind(self.device) == "cuda":
            return _gpu_memory_bytes(self.device)
        return physical_memory_bytes()

    def stamp(self) -> dict[str, Any] | None:
        return None

    def warm(self) -> None:
        pass  # nothing to set up before a session exists: each has its own thread pool


def _gpu_memory_bytes(device: str) -> int:
    """The GPU's memory as nvidia-smi reports it (ONNX Runtime does not say)."""
    index = device.partition(":")[2] or "0"
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                          "nounits", "-i", index], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[0]) * 2**20
