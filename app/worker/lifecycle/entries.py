"""Where a held request waits, decided once its inputs are at hand.

A request for a continuously batching runtime waits in `batching.feeder` (a `Waiting`);
any other in its model's scheduler lane (a `Pending`), whole or, if it is too big for one
batch, as its first part (`app.worker.lifecycle.splits`) - or it is refused
DEADLINE_TOO_SHORT when its parts could not finish within its whole deadline. `Entries`
decides it (`place`: a `Place` or a `Refuse`), and builds the scheduler's entries the loop
makes later (a split request's next part, a request its LoRA adapter released). It reads
the lanes and the catalog; it changes nothing.
"""

from __future__ import annotations

import time

from app.worker import metrics
from app.worker.lifecycle.decisions import Place, Refuse
from app.worker.lifecycle.held import Held
from app.worker.lifecycle.splits import split_request, too_long_for
from batching.feeder import Waiting
from batching.lanes import Lane
from batching.shapes import Pending
from tasks.envelope import EstimatingEntry, now_ms
from tasks.errors import ErrorCode

# The clocks a request's entry is made with: (monotonic s, epoch ms).
Clock = tuple[float, int]


class Entries:
    """Where held requests wait, and their entries there (loop thread, no state)."""

    def __init__(self, lanes: dict[str, Lane], entries: dict[str, EstimatingEntry],
                 continuous: set[str], part_target_s: float | None,
                 lora_mixed_batches: bool) -> None:
        self.lanes = lanes
        self.entries = entries  # the catalog's: how a split request's parts are estimated
        self.continuous = continuous  # the models whose runtime batches continuously
        self.part_target_s = part_target_s  # the longest a part of a split request should run
        self.lora_mixed_batches = lora_mixed_batches

    def place(self, model: str, held: Held, deliveries: int,
              clock: Clock | None = None) -> Place | Refuse:
        """Where a request, its inputs at hand, waits (`clock`: read once for the members
        of a coalesced message, delivered together)."""
        now, wall_ms = clock or (time.monotonic(), now_ms())
        if model in self.continuous:
            return Place(model, held, deliveries, self.waiting(held, deliveries, now, wall_ms))
        split = split_request(held, self.lanes[model], self.entries.get(model),
                              self.part_target_s)
        if split is not None:
            metrics.SPLIT.labels(model).inc()
            a = held.annotations
            why = too_long_for(split, None if a.deadline_ms is None or a.sent_ms is None
                               else (a.deadline_ms - a.sent_ms) / 1000)
            if why is not None:
                return Refuse(model, held, why, ErrorCode.DEADLINE_TOO_SHORT)
            held = split.part_held(held, 0)
        return Place(model, held, deliveries, self.pending(held, deliveries, now, wall_ms))

    def pending(self, held: Held, deliveries: int, now: float | None = None,
                wall_ms: int | None = None) -> Pending:
        """A request's entry in its model's scheduler lane."""
        if now is None or wall_ms is None:
            now, wall_ms = time.monotonic(), now_ms()
        annotations = held.annotations
        deadline = annotations.deadline_ms
        split = held.split is not None
        # Positional (in `Pending`'s field order): keywords cost 0.3 us more per request.
        return Pending(
            held,  # handle
            # group: parts batch only with parts: a short request batched with a part would
            # be padded to the part's length and wait as long as it. LoRAs mix unless
            # SHOAL_LORA_MIXED_BATCHES=false.
            (annotations.op, split) if self.lora_mixed_batches
            else (annotations.op, split, annotations.lora),
            annotations.items,
            annotations.cost,
            annotations.longest,
            now,  # received
            None if deadline is None else now + (deadline - wall_ms) / 1000,  # deadline
            None if deadline is None or annotations.sent_ms is None  # budget_s
            else (deadline - annotations.sent_ms) / 1000,
            deliveries,
            not split,  # returnable
            held.task_id,  # key
            annotations.bulk,
        )

    @staticmethod
    def waiting(held: Held, deliveries: int, now: float, wall_ms: int) -> Waiting:
        """A request's entry in a continuously batching runtime's feeder."""
        deadline = held.annotations.deadline_ms
        return Waiting(held, now, None if deadline is None else now + (deadline - wall_ms) / 1000,
                       deliveries, key=held.task_id)
