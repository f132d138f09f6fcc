"""The pool-state publisher step: this worker's models, told to its peers and the gateways.

Publishes the placement's snapshot (`app.worker.pool_states`) every
SHOAL_POOL_STATE_INTERVAL_S and on the loop's next turn after a model's state changes;
reads its peers' states, which say whether a peer holds a model warm
(`ModelQueueConsumer.warm_peers`) and, with SHOAL_PLACEMENT=fleet, make the fleet's plan
that the loop follows every FLEET_TICK_S (`app.worker.lifecycle.fleet`). On shutdown it
says farewell (a state with no models), so gateways stop counting this worker at once
rather than when its state goes stale.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from app.worker.lifecycle.fleet import FLEET_TICK_S
from app.worker.pool_states import PoolStates
from app.worker.steps.model_queues import ModelQueueConsumer


class PoolStatePublisher(bootsteps.StartStopStep):
    """Sets `c.shoal_pool_states`."""

    requires = (ModelQueueConsumer,)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        settings = c.shoal_queues.settings
        self.interval_s = settings.pool_state_interval_s
        self.pool_states = c.shoal_pool_states = PoolStates(settings.queue_prefix,
                                                            self.interval_s)
        self.timer: Any = None
        self.fleet_timer: Any = None

    def start(self, c: Any) -> None:
        queues = c.shoal_queues
        if not queues.started:
            return
        view = queues.view
        self.pool_states.busy_seconds = view.busy_seconds
        self.pool_states.open(c, view.snapshot)
        view.on_placement(self.pool_states.soon)
        # A runtime restarting (refusing batches) and serving again is told at once, from
        # the runtime's threads to the loop (where the state is published).
        # (Every runtime has both: `runtimes.base.RuntimeStatistics`; one that cannot
        # restart says None and never calls back.)
        runtime = queues.runtime
        self.pool_states.ready_in = runtime.ready_in
        runtime.watch_availability(lambda: c.hub.call_soon(self.pool_states.soon))
        self.timer = c.hub.call_repeatedly(self.interval_s, self.pool_states.publish)
        if c.shoal_queues.settings.placement == "fleet":
            # The fleet's plan, from the peers' latest states (app.worker.lifecycle.fleet).
            self.fleet_timer = c.hub.call_repeatedly(
                FLEET_TICK_S, lambda: view.follow_fleet(c.hostname, self.pool_states.fresh()))

    def stop_publishing(self) -> None:
        """No more periodic states (a drain, a stop), nor plans."""
        for timer in (self.timer, self.fleet_timer):
            if timer is not None:
                timer.cancel()
        self.timer = self.fleet_timer = None

    def farewell(self) -> None:
        """Gateways stop counting this worker as serving its models now."""
        self.pool_states.farewell()

    def stop(self, c: Any) -> None:
        self.stop_publishing()
        view = c.shoal_queues.view
        if view is not None:
            view.on_placement(lambda: None)

    def shutdown(self, c: Any) -> None:
        # Gateways stop counting this worker as serving its models now, not when its
        # state goes stale.
        self.farewell()
