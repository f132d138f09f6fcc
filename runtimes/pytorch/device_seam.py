"""The device as the PyTorch engine's forward path sees it: where a model's passes queue
and where the host waits for them. The real device (`RealDevice`) adds nothing here, so
production runs PyTorch's own model and nothing else.

A stand-in for the device (benchmarks and tests: `runtimes.doubles`) takes its place when
a setting the stand-ins declare is set in the process: `configured()`, called when the
engine is built (`TorchEngine`, which may also be handed one) and when a model loads,
asks the stand-ins' package by its name (the only place production code reaches it, so
no product module imports `runtimes.doubles`) and installs what it supplies. The engine
reads `current()` where a device would differ: after a model loads (its forward may be
replaced), around a dense batch's passes (queued as a GPU's kernels are), where the host
reads outputs (waits for the queued passes), and in the results' stamp.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

STAND_INS = "runtimes.doubles"  # its `device_seam()`: the seam a setting asks for, or None


class DeviceSeam(Protocol):
    def replaces_forward(self) -> bool:
        """Whether a model loaded now gets a stand-in's forward (it launches no kernels:
        then no CUDA graphs)."""

    def loaded(self, model: Any, model_class: Any, ref: str) -> None:
        """After the busy-time clock watches `model`: its forward may be replaced;
        ValueError fails the load."""

    def queued(self) -> AbstractContextManager[None]:
        """Passes inside may return at once, queued; `queued_until` says when they end."""

    def queued_until(self) -> float | None:
        """When this thread's queued passes end (None: none queued since the last call)."""

    def wait_queued(self, until: float | None) -> None:
        """Wait until `queued_until()`'s passes have run."""

    def stamp(self) -> dict[str, Any] | None:
        """What to mark this process's results with (None: nothing to mark)."""


class RealDevice:
    """The device itself: its passes are PyTorch's (on CUDA a stream queues them and the
    host's copies wait for them), so there is nothing to add."""

    def replaces_forward(self) -> bool:
        return False

    def loaded(self, model: Any, model_class: Any, ref: str) -> None:
        return None

    def queued(self) -> AbstractContextManager[None]:
        return nullcontext()

    def queued_until(self) -> float | None:
        return None

    def wait_queued(self, until: float | None) -> None:
        return None

    def stamp(self) -> dict[str, Any] | None:
        return None


REAL = RealDevice()
_seam: DeviceSeam = REAL


def install(seam: DeviceSeam) -> None:
    global _seam
    _seam = seam


def current() -> DeviceSeam:
    """The installed seam: the real device unless a stand-in was installed."""
    return _seam


def configured() -> DeviceSeam:
    """`current()`, a stand-in installed first when a setting of the stand-ins is set in
    this process (none is: the real device; the stand-ins' package's own module, which
    imports nothing heavy, is all that was imported to tell)."""
    if _seam is REAL:
        stand_in = importlib.import_module(STAND_INS).device_seam()
        if stand_in is not None:
            install(stand_in)
    return _seam
