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

from celery.worker import state as worker_state

from app.worker import metrics
from app.worker.lifecycle.batches import REVOKED_MESSAGE
from app.worker.lifecycle.decisions import Refuse
from app.worker.lifecycle.held import Holdings
from tasks.errors import ErrorCode


class Revokes:
    """Decides what becomes of revoked requests (loop thread); the loop answers them and
    tells the runtime."""

    def __init__(self, holdings: Holdings) -> None:
        self.holdings = holdings

    def revoke(self, task_ids: list[str]) -> tuple[list[Refuse], list[str]]:
        """Release these requests (see the module): the refusals of those held (taken out
        of wherever they waited), and the ids of those running here (the runtime is told)."""
        worker_state.revoked.update(task_ids)
        wanted = set(task_ids)
        refusals: list[Refuse] = []
        for model, held in self.holdings.withdraw(wanted):
            metrics.REVOKED.labels(model, "held").inc()
            refusals.append(Refuse(model, held, REVOKED_MESSAGE, ErrorCode.CANCELLED))
        running: list[str] = []
        for held in self.holdings.running():
            if held.task_id in wanted:
                metrics.REVOKED.labels(held.annotations.model, "running").inc()
                running.append(held.task_id)
        return refusals, running
