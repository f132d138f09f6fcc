"""The continuous feed: what becomes of the requests for a runtime that batches
continuously (SGLang).

A model whose runtime batches continuously (`Runtime.continuous`) gets no batches from
the scheduler: its requests wait in `batching.feeder` and are handed to the runtime one by
one as it has room, each answered when it ends. `Feed` reads the feeder's decisions on
the loop thread and returns them as the loop's (`app.worker.lifecycle.decisions`): refuse
what expired, give back what waited too long while a peer could take it, `Submit` what
fits; the loop applies them (the hand-over itself: `app.worker.lifecycle.generations`).
It is given what it reads of the rest: whether a model is resident, the runtime's load,
the queue's consumers.
"""

from __future__ import annotations

from collections.abc import Callable

from app.worker import metrics
from app.worker.lifecycle.decisions import GiveBack, Refuse, Submit
from batching.feeder import Feeder, Load
from tasks.errors import ErrorCode

# How often a continuous runtime without room is asked again for its load.
FEED_POLL_S = 0.05

FeedDecision = Refuse | GiveBack | Submit


class Feed:
    """Decides for the continuously batching runtime's models (loop thread)."""

    def __init__(self, feeder: Feeder, models: set[str], resident: Callable[[str], bool],
                 load_of: Callable[[str], Load], peers: Callable[[str, float], int]) -> None:
        self.feeder = feeder
        self.models = models  # the models whose runtime batches continuously
        self.resident = resident  # the model is loaded: its requests may be handed over
        self.load_of = load_of  # the runtime's room for a model
        self.peers = peers  # the queue's consumers (a request could be given back to)

    def feed(self, now: float) -> tuple[list[FeedDecision], float | None]:
        """What expired (refused), what waited too long while a peer could take it (given
        back), what the runtime has room for (submitted), in that order; seconds until
        this must run again, or None."""
        decisions: list[FeedDecision] = [
            Refuse(model, late.handle,
                   "the request's deadline passed while it waited for the model",
                   ErrorCode.DEADLINE_EXCEEDED)
            for model, late in self.feeder.expired(now)]
        peers = {}
        poll: float | None = None
        for model in self.models:
            if not self.feeder.waiting.get(model):
                continue
            peers[model] = self.peers(model, now)
            back = self.feeder.returns(model, now, peers[model])
            if back:
                decisions.append(GiveBack(model, [w.handle for w in back]))
            if self.resident(model):
                decisions += [Submit(model, waiting.handle)
                              for waiting in self.feeder.take(model, self.load_of(model))]
                if self.feeder.waiting.get(model):
                    # No room now: it frees as SGLang finishes requests (ours are answered
                    # and tick again, but aborts and its KV cache are its own).
                    poll = FEED_POLL_S
            metrics.HELD.labels(model).set(len(self.feeder.waiting.get(model, ())))
        wake = self.feeder.wake_in(now, peers)
        return decisions, poll if poll is not None and (wake is None or poll < wake) else wake
