"""An unloaded model's tensors out to host memory and back: PyTorch's part of the
host-memory tier (issue 51, `runtimes.child_side.host_tier`).

Adapters hold their torch modules in plain attributes (`adapter.model`,
`adapter.encoder.model`, a CLIP's towers) and a few bare tensors beside them (the
multivector projection's frozen `Linear` dataclasses), so the move is a generic walk of
the adapter's attributes, three levels deep, through objects, dataclasses, lists and
tuples (dicts are left alone; a frozen dataclass or a tuple that held a moved tensor is
rebuilt): a `torch.nn.Module` moves whole (`Module._apply`, what `Module.to` does: a
parameter tied to another stays one parameter), a bare tensor is replaced by its copy.
Only tensors on the device move out, and only the host copies made here move back, so a
tensor an adapter keeps on the CPU on purpose stays there.

On CUDA the host copies are in pinned memory (the copy back then runs at the bus's
speed). CUDA graphs captured for a model (`runtimes.pytorch.buckets`) point at its device
tensors: they are dropped when the model moves out and captured again when it moves back,
outside the device clock (a capture is no batch's work).

On a CPU device there is nothing to move: keeping the adapter is the whole saving (no
read of the files, no build of the modules).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from runtimes.pytorch import buckets
from runtimes.pytorch.device_time import device_clock

DEPTH = 3  # the adapter's attributes, theirs, and the items of a list or tuple there

# Adapter -> the storages (data pointers) of the host copies made for it.
_copies: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


def to_host(adapter: Any) -> int:
    """Move the adapter's device tensors to pinned host memory (its CUDA graphs dropped):
    the bytes of the host copies."""
    made: set[int] = set()
    total = 0

    def out(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not t.is_cuda:
            return t  # on the host already (or a tied tensor moved a moment ago)
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        made.add(host.untyped_storage().data_ptr())
        total += host.untyped_storage().nbytes()
        return host

    with torch.no_grad():
        modules = _walk(adapter, out, DEPTH, set())
        for module in modules:
            runner = buckets.buckets_of(module)
            if runner is not None:
                runner.drop_graphs()
    _copies[adapter] = made
    return total


def to_device(adapter: Any, device: str, name: str) -> None:
    """Move the host copies `to_host` made back to `device`, and capture the CUDA graphs
    of its modules again (`name`: the model, for the capture's log line)."""
    made = _copies.pop(adapter, set())

    def back(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda or t.untyped_storage().data_ptr() not in made:
            return t
        return t.to(device, non_blocking=True)

    with torch.no_grad():
        modules = _walk(adapter, back, DEPTH, set())
    torch.cuda.current_stream(torch.device(device)).synchronize()  # the pinned copies go now
    clock = device_clock(device)
    for module in modules:
        runner = buckets.buckets_of(module)
        if runner is not None:
            with clock.paused():
                runner.capture(module, name)


def _walk(obj: Any, move: Callable[[torch.Tensor], torch.Tensor], depth: int,
          seen: set[int]) -> list[torch.nn.Module]:
    """Replace every tensor `obj` holds (see the module doc) by `move`'s; the modules
    moved, each once."""
    modules: list[torch.nn.Module] = []

    def walk(value: Any, depth: int) -> Any:
        if isinstance(value, torch.Tensor):
            return move(value)
        if isinstance(value, torch.nn.Module):
            if id(value) not in seen:
                seen.add(id(value))
                value._apply(move)
                modules.append(value)
            return value
        if depth == 0:
            return value
        if isinstance(value, list):
            for i, item in enumerate(value):
                new = walk(item, depth - 1)
                if new is not item:
                    value[i] = new
            return value
        if isinstance(value, tuple):
            items = [walk(item, depth - 1) for item in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value
            kind = type(value)
            return kind._make(items) if hasattr(kind, "_make") else kind(items)
        if isinstance(value, type) or id(value) in seen:
            return value
        dataclass = dataclasses.is_dataclass(value)
        if dataclass:  # a slotted one has no __dict__
            attributes = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        elif hasattr(value, "__dict__"):
            attributes = dict(vars(value))
        else:
            return value
        seen.add(id(value))
        changes = {}
        for name, attribute in attributes.items():
            new = walk(attribute, depth - 1)
            if new is not attribute:
                changes[name] = new
        if changes and dataclass and type(value).__dataclass_params__.frozen:  # type: ignore[attr-defined]
            return dataclasses.replace(value, **changes)
        for name, new in changes.items():
            setattr(value, name, new)
        return value

    walk(obj, depth)
    return modules
