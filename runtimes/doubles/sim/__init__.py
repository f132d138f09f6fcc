"""A simulated runtime: real request checks, a device's latency, fake numbers.

For fleet experiments on machines too small to run many real models; see
`runtimes.doubles.sim.runtime` and, for how a device's speed is chosen,
`runtimes.doubles.sim.devices`. Imports neither torch nor transformers.
"""

from runtimes.doubles.sim.devices import DEVICE_KINDS, DeviceKind, SimConstants, sim_constants
from runtimes.doubles.sim.runtime import SimRuntime

__all__ = ["DEVICE_KINDS", "DeviceKind", "SimConstants", "SimRuntime", "sim_constants"]
