"""What the worker's collaborators decide, for the loop alone to apply.

The loop (`app.worker.lifecycle.dispatcher`) feeds its collaborators events and applies
what they return, as it applies the scheduler's `batching.lanes.Actions`: `Intake` says
what each request of a message becomes (`Place`, `Fetch`, `Refuse`, `Fail`, or the whole
message `Reject`ed), the continuous `Feed` what to refuse, give back and `Submit`, the
`Drain` what to give back when it begins, `Revokes` what to refuse. None of them calls
back into the loop; the loop's events (a message, a tick, a batch or a continuous request
done, a claim fetched, a model placed) are the only way in.

Named tuples, not dataclasses: one is made per request on the hot path, and a tuple is
the cheapest immutable record Python makes (a frozen dataclass's `__init__` costs ~1 µs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from app.worker.lifecycle.held import Held
from app.worker.lifecycle.replies import Delivery
from batching.feeder import Waiting
from batching.shapes import Pending
from tasks.errors import ErrorCode


class Place(NamedTuple):
    """A request, its inputs at hand, goes where it waits: `entry` in its model's
    scheduler lane (a `Pending`) or the continuous feeder (a `Waiting`); the loop parks
    it instead while its LoRA adapter is not loaded, and loads what it needs."""

    model: str
    held: Held
    deliveries: int
    entry: Pending | Waiting


class Fetch(NamedTuple):
    """A request whose claimed inputs are fetched first (`app.worker.lifecycle.claims`);
    placed when they are here."""

    model: str
    held: Held
    deliveries: int


class Refuse(NamedTuple):
    """A held request answered with an error, unrun (`Answers.refuse`)."""

    model: str
    held: Held
    why: str
    code: ErrorCode


class Fail(NamedTuple):
    """A request answered with an error before it is held (a wrong queue, a body that
    cannot be read)."""

    delivery: Delivery
    task_id: str
    code: ErrorCode
    why: str


class Reject(NamedTuple):
    """A message nobody can read: dead-lettered."""

    message: Any


class GiveBack(NamedTuple):
    """Requests given back to their model's queue (`app.worker.lifecycle.returns`);
    `renew`: whether a message must be republished rather than requeued (a drain's)."""

    model: str
    held: list[Held]
    renew: Callable[[Delivery], bool] | None = None


class Submit(NamedTuple):
    """A request handed to the continuously batching runtime."""

    model: str
    held: Held


Decision = Place | Fetch | Refuse | Fail | Reject | GiveBack | Submit


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """The loop's settings (`tasks.settings.Settings`' worker fields, in seconds)."""

    part_target_s: float | None = None  # the longest a part of a split request should run
    prefetch: int = 64  # a loaded model's consumer prefetch, before the scheduler adapts it
    lora_mixed_batches: bool = True  # requests for different LoRAs share a batch
    feed_return_after_s: float = 0.2  # a continuous runtime's wait before giving back
    blob_url: str = ""  # the claims' blob store
    claim_upload_timeout_s: float = 10.0
