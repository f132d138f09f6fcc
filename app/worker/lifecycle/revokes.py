"""Revokes: a request whose caller left or was revoked is released at once, wherever it is.

A gateway revokes the requests whose callers hung up (`shoal_cancel`, batched: see
`gateway.broker.revokes`); a Celery client revokes with Celery's own `revoke` (both reach
`revoke` through `app.worker.control`). Like a passed deadline, a revoke is answered when
it comes, not when the request's batch would have formed:

- held and not started (in its model's backlog, a split request's parts left, waiting for
  a continuous runtime's room, parked for its LoRA adapter, fetching its claims): taken
  out (`Holdings.withdraw`) and answered CANCELLED now;
- running (in a batch handed to the runtime, or generating): the runtime is told
  (`Runtime.cancel`): a batch still queued in the runtime process drops it before the
  device (`runtimes.child_side.host`), a generation stops at its next token;
- not delivered yet: its id stays in Celery's revoked set, and `Intake` answers it
  CANCELLED on arrival (a batch checks the set once more as it starts).

Answered rather than dropped without a word: every member of a coalesced message is
answered once and the message acked once all are (one dropped silently would keep its
message unacked), and a Celery client's `AsyncResult.get()` returns CANCELLED at once
instead of waiting for its timeout. A gateway whose caller left drops that answer (one
small reply, counted in shoal_gateway_duplicate_replies_total).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.lifecycle.answers import Answers
from app.worker.lifecycle.batches import REVOKED_MESSAGE
from app.worker.lifecycle.held import GENERATING, RUNNING, Holdings
from tasks.errors import ErrorCode


class Revokes:
    """Releases revoked requests (loop thread)."""

    def __init__(self, holdings: Holdings, answers: Answers, runtime: Any,
                 queue_tick: Callable[[], None]) -> None:
        self.holdings = holdings
        self.answers = answers
        self.runtime = runtime  # told of the revoked requests it runs
        self.queue_tick = queue_tick  # what was released frees credit for more

    def revoke(self, task_ids: list[str]) -> list[str]:
        """Release these requests (see the module); the ids that were running here."""
        worker_state.revoked.update(task_ids)
        wanted = set(task_ids)
        released = self.holdings.withdraw(wanted)
        for model, held in released:
            metrics.REVOKED.labels(model, "held").inc()
            self.answers.refuse(model, held, REVOKED_MESSAGE, ErrorCode.CANCELLED)
        running: list[str] = []
        for state, model, held in self.holdings.states():
            if state in (RUNNING, GENERATING) and held.task_id in wanted:
                metrics.REVOKED.labels(model, "running").inc()
                running.append(held.task_id)
        if running:
            self.runtime.cancel(running)
        if released:
            self.queue_tick()
        return running
