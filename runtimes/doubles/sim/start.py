"""How a worker with SHOAL_RUNTIME=sim starts its runtime (the registry's `start` of sim,
`tasks.engines`): named by a string there, so no production module imports the doubles."""

from __future__ import annotations

import logging

from runtimes.doubles.sim.runtime import SimRuntime
from runtimes.model_files.footprint import host_tier_bytes
from tasks.catalog import ModelEntry
from tasks.settings import Settings

log = logging.getLogger(__name__)


def start_runtime(entries: list[ModelEntry], pinned: list[str], settings: Settings
                  ) -> SimRuntime:
    """A `runtimes.base.StartRuntime`: every model of the worker on a simulated device."""
    log.warning("SIMULATED runtime: no model runs; %s batches sleep as a %s would "
                "(speed x%g) and results are fake", [e.id for e in entries],
                settings.device, settings.sim_speed)
    return SimRuntime(entries, settings.device, settings.sim_speed, settings.sim_constants,
                      loaded=sorted(pinned),
                      host_bytes=host_tier_bytes(settings.host_memory_bytes))
