"""What a model takes in device memory: estimated from its files before it loads, and
measured from its tensors once loaded.

The estimate needs no torch (the worker makes it on its event loop); the measurement
runs in the runtime process, next to the tensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Weight files, best first: a folder with safetensors often also ships the same weights
# as a .bin, and only one of them is loaded.
_WEIGHT_KINDS = (("*.safetensors",), ("*.bin", "*.pt", "*.pth"))
# What a folder without weight files (or an unreadable one) is taken to need.
UNKNOWN_BYTES = 64 * 2**20


def estimate_bytes(directory: str | Path) -> int:
    """The bytes of a model's weight files: what its tensors take once loaded in the dtype
    they were saved in (the largest error is a model saved in fp32 and loaded in fp16)."""
    root = Path(directory)
    for patterns in _WEIGHT_KINDS:
        files = [f for pattern in patterns for f in root.rglob(pattern) if f.is_file()]
        if files:
            return sum(f.stat().st_size for f in files)
    return UNKNOWN_BYTES


def tensor_bytes(obj: Any) -> int:
    """The bytes of every parameter and buffer of the torch modules `obj` holds (itself,
    or in its attributes, two levels deep), each tensor storage counted once."""
    import torch

    seen: set[int] = set()
    total = 0
    for module in _modules(obj, depth=2, found=[]):
        for tensor in (*module.parameters(), *module.buffers()):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _modules(obj: Any, depth: int, found: list[Any]) -> list[Any]:
    import torch

    if isinstance(obj, torch.nn.Module):
        if all(obj is not m for m in found):
            found.append(obj)
        return found
    if depth == 0 or not hasattr(obj, "__dict__"):
        return found
    for value in vars(obj).values():
        _modules(value, depth - 1, found)
    return found


def physical_memory_bytes() -> int:
    """This machine's RAM: the device memory of a CPU runtime."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_tier_bytes(setting: int | None) -> int:
    """The host-memory tier's budget (issue 51) from SHOAL_HOST_MEMORY_BYTES: the setting,
    else a quarter of this machine's RAM (0: the tier is off)."""
    return physical_memory_bytes() // 4 if setting is None else setting
