"""Stand-ins for a device or a model, for benchmarks and tests: the emulated GPU-class
device, faulty adapters, the simulated runtime. No product module imports them: they are
reached by module name (`runtimes.pytorch.device_seam.STAND_INS` asks `device_seam` below,
the registry's `sim` engine, the test families' "module:Class" strings).
"""

from __future__ import annotations

import os
from typing import Any


def device_seam() -> Any:
    """The PyTorch engine's device seam (`runtimes.pytorch.device_seam.DeviceSeam`) that
    this process's settings ask for: the emulated device where SHOAL_EMULATE_DEVICE is set
    (`runtimes.doubles.emulated`), else None (the real device)."""
    from runtimes.doubles.profiles import ENV

    if not os.environ.get(ENV, "").strip():
        return None
    from runtimes.doubles.emulated import EmulatedDevice

    return EmulatedDevice()
