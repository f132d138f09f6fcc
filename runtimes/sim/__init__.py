"""A simulated runtime: real request checks, a device's latency, fake numbers.

For fleet experiments on machines too small to run many real models; see
`runtimes.sim.runtime` and, for how a device's speed is chosen,
`runtimes.sim.devices`. Imports neither torch nor transformers.
"""

from runtimes.sim.devices import DEVICE_KINDS, DeviceKind, SimConstants, sim_constants
from runtimes.sim.runtime import SimRuntime

__all__ = ["DEVICE_KINDS", "DeviceKind", "SimConstants", "SimRuntime", "sim_constants"]
