"""How long a simulated device takes: the cost constants the sim runtime sleeps by.

A batch takes a + b*T + c*T*L seconds (T padded tokens, L longest item; the
model of `batching.latency_model`), so a device is three constants per model. They are
chosen, first match wins:

1. explicit constants `(a_ms, b_us, c_ns)` (SHOAL_SIM_COST_*): an experiment
   that wants exact numbers gets them, whatever the device;
2. the catalog entry's profile for the device (`profiles: {t4: ...}`): a
   calibrated profile, measured on that hardware, is the best guess there is;
3. the entry's `cpu` profile (or `BatchProfile`'s defaults) scaled by the
   device kind's row of `DEVICE_KINDS` below.

The table is a set of ASSUMPTIONS, not measurements: rough throughput of
small BERT-class encoders (MiniLM-L6 to BERT-base, fp16 on GPUs, eager
PyTorch) relative to the 2-core CPU the catalog's `cpu` profiles were measured
on, read off public datasheets (fp16 tensor throughput, memory bandwidth) and
discounted because small models leave most of a big GPU idle. They are there
so a fleet experiment can say "four T4s" before anyone has measured one;
replace them with calibrated profiles (`shoal tune` on the hardware, written
into the catalog entry) as soon as such a machine is at hand, which case 2
then picks up without any change here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batching.latency_model import CostModel
from tasks.catalog import BatchProfile, ModelEntry


@dataclass(frozen=True, slots=True)
class DeviceKind:
    """An assumed device: how much faster than the reference CPU, and its batch floor."""

    name: str
    speed: float  # per-token throughput relative to the catalog's `cpu` profile
    # The least fixed cost of a batch: a GPU launches ~10 kernels per layer
    # and copies inputs and outputs whatever the batch size, so dividing the
    # CPU's overhead by `speed` would make tiny batches unrealistically cheap.
    min_overhead_ms: float
    note: str


DEVICE_KINDS: dict[str, DeviceKind] = {
    k.name: k
    for k in (
        DeviceKind("cpu", 1.0, 0.0, "the reference: catalog cpu profiles (2-core x86)"),
        DeviceKind("t4", 30.0, 1.5, "Turing, 65 TFLOPS fp16 tensor, 320 GB/s"),
        DeviceKind("l4", 60.0, 1.0, "Ada, 121 TFLOPS fp16 tensor, 300 GB/s"),
        DeviceKind("a10", 60.0, 1.0, "Ampere, 125 TFLOPS fp16 tensor, 600 GB/s"),
        DeviceKind("a100", 150.0, 0.8, "Ampere, 312 TFLOPS fp16 tensor, 1.6-2 TB/s"),
        DeviceKind("h100", 250.0, 0.6, "Hopper, ~990 TFLOPS fp16 tensor, 3.35 TB/s"),
    )
}


@dataclass(frozen=True, slots=True)
class SimConstants:
    """A simulated device's cost constants for one model, and where they came from."""

    a_ms: float
    b_us: float
    c_ns: float
    source: str  # "explicit", "profile:<device>" or "cpu/<speed> (assumed <kind>)"

    def cost_model(self) -> CostModel:
        """The batch latency model in seconds: the scheduler's own formula, never refitted."""
        return CostModel(self.a_ms / 1000, self.b_us / 1e6, self.c_ns / 1e9)


def device_kind(device: str) -> DeviceKind:
    """The table's row for a device name ('t4', 'H100', 'cuda'-style indices dropped).

    Raises ValueError naming the known kinds: a typo would otherwise silently
    simulate the wrong hardware.
    """
    kind = device.strip().lower().split(":", 1)[0]
    if kind not in DEVICE_KINDS:
        raise ValueError(f"unknown simulated device {device!r}; known device kinds: "
                         f"{sorted(DEVICE_KINDS)} (or give the model a catalog profile for it, "
                         "or explicit SHOAL_SIM_COST_* constants)")
    return DEVICE_KINDS[kind]


def check_constants(constants: tuple[float, float, float]) -> tuple[float, float, float]:
    """`(a_ms, b_us, c_ns)` as floats; ValueError unless three finite values >= 0."""
    if len(constants) != 3:
        raise ValueError(f"cost constants are (a_ms, b_us, c_ns), got {constants!r}")
    values = tuple(float(v) for v in constants)
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"cost constants must be finite and >= 0, got {constants!r}")
    return values  # type: ignore[return-value]


def sim_constants(entry: ModelEntry, device: str,
                  constants: tuple[float, float, float] | None = None) -> SimConstants:
    """The constants a simulated `device` runs `entry` with (see the module docstring).

    The device table is consulted only when neither explicit constants nor a
    catalog profile apply, so a calibrated device needs no row in it.
    """
    if constants is not None:
        a_ms, b_us, c_ns = check_constants(constants)
        return SimConstants(a_ms, b_us, c_ns, "explicit")
    profile = entry.profile(device)
    if profile is not None:
        return SimConstants(profile.cost_a_ms, profile.cost_b_us, profile.cost_c_ns,
                            f"profile:{device}")
    kind = device_kind(device)
    base = entry.profile("cpu") or BatchProfile()
    return SimConstants(
        a_ms=max(base.cost_a_ms / kind.speed, kind.min_overhead_ms),
        b_us=base.cost_b_us / kind.speed,
        c_ns=base.cost_c_ns / kind.speed,
        source=f"cpu/{kind.speed:g} (assumed {kind.name})",
    )
