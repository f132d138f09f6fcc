"""The continuous feed: requests for a runtime that batches continuously (SGLang).

A model whose runtime batches continuously (`Runtime.continuous`) gets no batches from
the scheduler: its requests wait in `batching.feeder` (which decides) and are handed
to the runtime one by one as it has room, each answered when it ends. `Feed` applies the
feeder's decisions on the loop thread: it answers what expired, gives back what waited too
long while a peer could take it, submits what fits, and turns each request's end into its
outcome (`finish`); answering it, and what follows, is the loop's
(`app.worker.lifecycle.dispatcher`), which it reaches through the `done` callback it is
given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from app.worker import metrics
from app.worker.lifecycle.answers import Answers
from app.worker.lifecycle.batches import decode_requests, mark_started
from app.worker.lifecycle.consumers import Consumers
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.loop import Loop
from app.worker.lifecycle.placement import Placement
from app.worker.lifecycle.replies import Replier
from app.worker.lifecycle.returns import Returns
from app.worker.lifecycle.streams import Streams
from batching.feeder import Feeder
from runtimes.base import Outcome, Runtime
from tasks.errors import ErrorCode
from tasks.pool_state import RESIDENT

log = logging.getLogger(__name__)

# How often a continuous runtime without room is asked again for its load.
FEED_POLL_S = 0.05


class Feed:
    """Feeds the continuously batching runtime's models (loop thread)."""

    def __init__(self, runtime: Runtime, feeder: Feeder, models: set[str],
                 placement: Placement, consumers: Consumers, answers: Answers,
                 returns: Returns, streams: Streams, replier: Replier, loop: Loop,
                 done: Callable[[int, str, Held, Future], None]) -> None:
        self.runtime = runtime
        self.feeder = feeder
        self.models = models  # the models whose runtime batches continuously
        self.placement = placement
        self.consumers = consumers  # the peers a request could be given back to
        self.answers = answers
        self.returns = returns
        self.streams = streams
        self.replier = replier
        self.loop = loop  # woken when a request ends
        self.done = done  # the loop's: (generation, model, request, future), on the loop

    def feed(self, generation: int) -> float | None:
        """Answer what expired, give back what waited too long while a peer could take it,
        hand the runtime what it has room for; seconds until this must run again."""
        now = time.monotonic()
        for model, late in self.feeder.expired(now):
            self.answers.refuse(model, late.handle,
                                "the request's deadline passed while it waited for the model")
        peers = {}
        poll: float | None = None
        for model in self.models:
            if not self.feeder.waiting.get(model):
                continue
            peers[model] = self.consumers.peers(model, now)
            back = self.feeder.returns(model, now, peers[model])
            if back:
                self.returns.give_back(model, [w.handle for w in back])
                metrics.RETURNS.labels(model).inc(len(back))
            if self.placement.state(model) == RESIDENT:
                for waiting in self.feeder.take(model, self.runtime.load_of(model)):
                    self._submit(model, waiting.handle, generation)
                if self.feeder.waiting.get(model):
                    # No room now: it frees as SGLang finishes requests (ours are answered
                    # here and tick again, but aborts and its KV cache are its own).
                    poll = FEED_POLL_S
            metrics.HELD.labels(model).set(len(self.feeder.waiting.get(model, ())))
        wake = self.feeder.wake_in(now, peers)
        return poll if poll is not None and (wake is None or poll < wake) else wake

    def _submit(self, model: str, held: Held, generation: int) -> None:
        """Hand one request to the continuous runtime; its outcome comes back on the loop."""
        requests, refused = decode_requests([held])
        if refused:
            self.answers.answer(model, held, refused[held.task_id])
            return
        (request,) = requests
        mark_started(self.replier, model, held, time.time())
        self.placement.touch(model)
        self.feeder.started(model, held.task_id, held)
        metrics.IN_FLIGHT.labels(model).set(len(self.feeder.in_flight[model]))
        on_deltas = self.streams.queuer(generation, [held]) if request.stream else None
        future = self.runtime.submit(model, request, on_deltas)  # type: ignore[attr-defined]
        future.add_done_callback(lambda f: self.loop.call_soon(
            self.done, generation, model, held, f))

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
