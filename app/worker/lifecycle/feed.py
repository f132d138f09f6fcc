"""Continuous feed: requests for a runtime that batches continuously (SGLang).

A model whose runtime batches continuously (`Runtime.continuous`) gets no batches from
the scheduler: its requests wait in `batching.feeder` (which decides) and are handed
to the runtime one by one as it has room, each answered when it ends. This module applies
the feeder's decisions on the loop thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from app.worker import metrics
from app.worker.lifecycle.held import Held
from runtimes.base import Outcome
from tasks.errors import ErrorCode
from tasks.pool_state import RESIDENT

if TYPE_CHECKING:
    from app.worker.lifecycle.dispatcher import Dispatcher

log = logging.getLogger(__name__)

# How often a continuous runtime without room is asked again for its load.
FEED_POLL_S = 0.05


class Feed:
    """The dispatcher's continuous feed (loop thread); a mixin of `Dispatcher`."""

    def _feed(self: Dispatcher) -> float | None:
        """Answer what expired, give back what waited too long while a peer could take it,
        hand the runtime what it has room for; seconds until this must run again."""
        now = time.monotonic()
        for model, late in self.feeder.expired(now):
            self.answers.refuse(model, late.handle,
                         "the request's deadline passed while it waited for the model")
        peers = {}
        poll: float | None = None
        for model in self.continuous:
            if not self.feeder.waiting.get(model):
                continue
            peers[model] = self._peers(model, now)
            back = self.feeder.returns(model, now, peers[model])
            if back:
                self._give_back(model, [w.handle for w in back])
                metrics.RETURNS.labels(model).inc(len(back))
            if self.placement.state(model) == RESIDENT:
                for waiting in self.feeder.take(model, self.runtime.load_of(model)):
                    self._submit(model, waiting.handle)
                if self.feeder.waiting.get(model):
                    # No room now: it frees as SGLang finishes requests (ours are answered
                    # here and tick again, but aborts and its KV cache are its own).
                    poll = FEED_POLL_S
            metrics.HELD.labels(model).set(len(self.feeder.waiting.get(model, ())))
        wake = self.feeder.wake_in(now, peers)
        return poll if poll is not None and (wake is None or poll < wake) else wake

    def _submit(self: Dispatcher, model: str, held: Held) -> None:
        """Hand one request to the continuous runtime; its outcome comes back on the loop."""
        requests, refused = self._requests([held])
        if refused:
            self.answers.answer(model, held, refused[held.task_id])
            return
        (request,) = requests
        generation = self.generation
        self._mark_started(model, held, time.time())
        self.placement.touch(model)
        self.feeder.started(model, held.task_id, held)
        metrics.IN_FLIGHT.labels(model).set(len(self.feeder.in_flight[model]))
        on_deltas = self.streams.queuer(generation, [held]) if request.stream else None
        future = self.runtime.submit(model, request, on_deltas)  # type: ignore[attr-defined]
        future.add_done_callback(lambda f: self.c.hub.call_soon(
            self._on_request_done, generation, model, held, f))

    def _on_request_done(self: Dispatcher, generation: int, model: str, held: Held,
                         future: Future) -> None:
        self.streams.publish()  # its last deltas go before its result
        self.feeder.done(model, held.task_id)
        metrics.IN_FLIGHT.labels(model).set(len(self.feeder.in_flight.get(model, {})))
        try:
            outcome: Outcome = future.result()
        except Exception as exc:  # the contract says never; a bug must not lose the request
            log.exception("the runtime failed request %s", held.task_id)
            outcome = Outcome(held.task_id, error_code=ErrorCode.INTERNAL,
                              error_message=f"runtime failed: {exc!r}")
        if generation == self.generation:
            answering, self._answering = self._answering, True
            try:
                self.answers.answer(model, held, outcome)
            finally:
                self._answering = answering
        self._queue_tick()  # a slot is free: hand over the next
        self.check_drained()
