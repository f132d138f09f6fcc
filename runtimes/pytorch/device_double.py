"""The one seam a device double plugs into: None in production, so the forward path runs
PyTorch's own model and nothing else.

A benchmark sets `SHOAL_EMULATE_DEVICE` (`runtimes.doubles.emulated`: a GPU-class device
emulated on the CPU path). `configured()`, called when the engine starts and when a model
loads, then imports the double by its module's name (the only place production code
names it, so no product module imports `runtimes.doubles`) and the double installs itself
here. The engine reads `current()` where a device would differ: after a model loads (its
forward replaced), around a dense batch's passes (queued as a GPU's kernels are), where
the host reads outputs (waits for the queued passes), and in the results' stamp.
"""

from __future__ import annotations

import importlib
import os
from contextlib import AbstractContextManager
from typing import Any, Protocol

SETTING = "SHOAL_EMULATE_DEVICE"
DOUBLE_MODULE = "runtimes.doubles.emulated"  # its `install()` calls `install` below


class DeviceDouble(Protocol):
    def emulates(self) -> bool:
        """Whether a model loaded now gets the double's forward (then no CUDA graphs)."""

    def replace_forward(self, model: Any, model_class: Any, ref: str) -> None:
        """After the device clock watches `model`: its forward becomes the double's (or
        stays, when the double is off); ValueError fails the load."""

    def queued(self) -> AbstractContextManager[None]:
        """Passes inside return at once, queued; `queued_until` says when they end."""

    def queued_until(self) -> float | None:
        """When this thread's queued passes end (None: none queued since the last call)."""

    def wait_queued(self, until: float | None) -> None:
        """Wait until `queued_until()`'s passes have run."""

    def stamp(self) -> dict[str, Any] | None:
        """What to mark this process's results with (None: nothing here is emulated)."""


_double: DeviceDouble | None = None


def install(double: DeviceDouble | None) -> None:
    global _double
    _double = double


def current() -> DeviceDouble | None:
    """The installed double; None unless a setting asked for one."""
    return _double


def configured() -> DeviceDouble | None:
    """`current()`, the double installed first when its setting is set in this process."""
    if _double is None and os.environ.get(SETTING, "").strip():
        importlib.import_module(DOUBLE_MODULE).install()
    return _double
