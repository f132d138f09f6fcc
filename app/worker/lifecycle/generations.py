"""Requests handed to a continuously batching runtime, each generating until it ends.

The loop hands a request over when the `Feed` decides it (`Submit`): `submit` has the
runtime take it (its Flower task-started, its streamed deltas, its model touched) and
hands its end back to the loop (`done`, one event per request, through the loop handle);
`finish` frees its slot and reads its outcome.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from app.worker import metrics
from app.worker.lifecycle.batches import decode_requests, mark_started
from app.worker.lifecycle.held import Held, Holdings
from app.worker.lifecycle.loop import Loop
from app.worker.lifecycle.placement import Placement
from app.worker.lifecycle.replies import Replier
from app.worker.lifecycle.streams import Streams
from runtimes.base import Outcome, Runtime
from tasks.errors import ErrorCode

log = logging.getLogger(__name__)


class Generations:
    """The requests a continuous runtime generates (loop thread)."""

    def __init__(self, runtime: Runtime, holdings: Holdings, placement: Placement,
                 streams: Streams, replier: Replier, loop: Loop,
                 done: Callable[[int, str, Held, Future], None]) -> None:
        self.runtime = runtime
        self.holdings = holdings
        self.feeder = holdings.feeder
        self.placement = placement
        self.streams = streams
        self.replier = replier
        self.loop = loop  # woken when a request ends
        self.done = done  # the loop's: (generation, model, request, future), on the loop

    def submit(self, model: str, held: Held, generation: int) -> Outcome | None:
        """Hand one request the feeder took to the continuous runtime (its outcome comes
        back on the loop), or the outcome it gets unrun (undecodable, revoked, late)."""
        requests, refused = decode_requests([held])
        if refused:
            return refused[held.task_id]
        (request,) = requests
        self.holdings.generate(model, held)
        mark_started(self.replier, model, held, time.time())
        self.placement.touch(model)
        metrics.IN_FLIGHT.labels(model).set(len(self.feeder.in_flight[model]))
        on_deltas = self.streams.queuer(generation, [held]) if request.stream else None
        future = self.runtime.submit(model, request, on_deltas)
        future.add_done_callback(lambda f: self.loop.call_soon(
            self.done, generation, model, held, f))
        return None

    def finish(self, model: str, held: Held, future: Future) -> Outcome:
        """A request the runtime ended (loop): its slot is free; its outcome."""
        self.feeder.done(model, held.task_id)
        metrics.IN_FLIGHT.labels(model).set(len(self.feeder.in_flight.get(model, {})))
        try:
            return future.result()
        except Exception as exc:  # the contract says never; a bug must not lose the request
            log.exception("the runtime failed request %s", held.task_id)
            return Outcome(held.task_id, error_code=ErrorCode.INTERNAL,
                           error_message=f"runtime failed: {exc!r}")
