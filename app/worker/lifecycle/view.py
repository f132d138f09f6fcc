"""The worker as its bootsteps and remote control see it: one view of the loop.

The model-queue step consumes into it, the pool-state step publishes what it reads, the
drain step drains through it, and the remote-control commands (`app.worker.control`)
inspect, load, unload and cancel through it; none of them reaches through the loop into
its collaborators. What it asks of the loop the loop applies (`Dispatcher.refuse`,
`give_back`): a revoke's refusals, a drain's hand-back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.worker import metrics
from app.worker.lifecycle.dispatcher import Dispatcher
from app.worker.lifecycle.replies import Replier


class WorkerView:
    """What the worker's steps and remote control read and ask of the loop (loop thread)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._d = dispatcher
        # The loop's own method, not a wrapper: kombu calls it for every message.
        self.on_message: Callable[[Any], None] = dispatcher.on_message

    # --- consuming (the model-queue step) -----------------------------------------------

    @property
    def replier(self) -> Replier:
        """The answering side (the dead-letter queues' answers go out through it)."""
        return self._d.replier

    def open(self, connection: Any) -> None:
        """A (new) connection: the replies' confirm-mode channel on it."""
        self._d.replier.open(connection)

    def consume(self, model: str, consumer: Any, queue: str, count_peers: Callable[[], int],
                warm_peers: Callable[[], int]) -> None:
        self._d.consumers.consume(model, consumer, queue, count_peers, warm_peers)

    def drop_held(self) -> None:
        """The connection was lost: forget what is held (the broker redelivers it)."""
        self._d.drop_held()

    def close(self) -> None:
        """The worker stops: its threads, then the runtime."""
        d = self._d
        d.claims.close()
        d.placement.close()
        # The runtime first: a batch still running (a forced or cold shutdown; a drained
        # worker runs none) fails at once instead of holding the exit up.
        d.batches.shutdown(wait=False)
        d.runtime.close()
        d.batches.shutdown(wait=True)

    # --- the pool state (the pool-state step) -------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This worker's models, as `celery inspect shoal_models` and the pool state say."""
        return self._d.placement.snapshot()

    def busy_seconds(self) -> float:
        """The device's busy time in this worker's batches so far."""
        return self._d.batches.device_busy_s

    def on_placement(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever a model's state here changes."""
        self._d.on_placement = callback

    def follow_fleet(self, me: str, peers: list[dict[str, Any]]) -> None:
        """The fleet's plan from the peers' latest states (`app.worker.lifecycle.fleet`)."""
        self._d.fleet.follow(me, peers)

    # --- the drain (the drain step) -----------------------------------------------------

    def begin_drain(self, on_drained: Callable[[], None]) -> dict[str, int]:
        """Stop consuming, give back every request that has not started (what runs goes
        on); `on_drained` once it is all answered and confirmed. The requests given back,
        by model."""
        d = self._d
        d.drain.on_drained = on_drained
        d.consumers.stop()
        back = d.drain.begin({model: d.holdings.not_started(model)
                              for model in d.scheduler.lanes})
        for give in back:
            d.give_back(*give)
        for model, lane in d.scheduler.lanes.items():
            metrics.HELD.labels(model).set(len(lane.backlog))
        return {give.model: len(give.held) for give in back}

    def check_drain(self) -> None:
        self._d.drain.check()

    @property
    def answered(self) -> int:
        """Requests answered while draining."""
        return self._d.drain.answered

    @property
    def handed_back(self) -> int:
        """Requests handed back since the drain began."""
        return self._d.drain.handed_back

    @property
    def unfinished(self) -> int:
        """Requests running or bound to run here."""
        return self._d.holdings.unfinished

    def batch_sizes(self) -> list[int]:
        """The batches in flight, by their number of requests."""
        return [len(batch.members) for batch in self._d.scheduler.in_flight]

    @property
    def unconfirmed(self) -> int:
        """Publishes the broker has not confirmed yet."""
        return self._d.replier.unconfirmed

    def abandon(self) -> int:
        """A forced end: publish and ack nothing more (the broker redelivers it); the
        number of requests that were running or bound to run."""
        d = self._d
        unfinished = d.holdings.unfinished
        d.drain.abandon()
        d.drop_held()
        return unfinished

    # --- remote control (`app.worker.control`) ------------------------------------------

    def serves(self, model: str) -> bool:
        return model in self._d.scheduler.lanes

    def load(self, model: str) -> str | None:
        """Start loading a model (an operator asked): None, or why it cannot be."""
        return self._d.placement.ensure(model, asked=True)

    def state(self, model: str) -> str:
        """Resident, loading or cold here."""
        return self._d.placement.state(model)

    def unload(self, model: str) -> str | None:
        """Drop a model: None, or why not (pinned, or requests use it)."""
        return self._d.placement.unload(model)

    def cancel(self, task_ids: list[str]) -> list[str]:
        """Revoke requests: held ones answered CANCELLED at once, running ones cancelled in
        the runtime (`app.worker.lifecycle.revokes`). The ids that were running here."""
        d = self._d
        refusals, running = d.revokes.revoke(task_ids)
        for refusal in refusals:
            d.refuse(*refusal)
        if running:
            d.runtime.cancel(running)
        if refusals:
            d.ticks.queue()  # what was released frees credit for more
        return running
