"""What a worker holds: every delivered request not yet settled, and in which state.

A request is held from its delivery until it is answered or handed back, in one of these
states (`Holdings.states`):

- FETCHING: its claim-checked inputs are being fetched (`app.worker.lifecycle.claims`); it enters
  the scheduler only once they are here.
- PARKED: it waits for its LoRA adapter to load (and its model first), outside the
  scheduler; it joins the scheduler when the adapter is loaded.
- SCHEDULED: in its model's lane (`batching.scheduler`), waiting for a batch;
  RUNNING: in a batch in flight.
- WAITING: held for a continuously batching runtime (`batching.feeder`) until it has
  room; GENERATING: handed to that runtime.

The scheduler and the feeder keep their own queues (they decide on them); this module
owns the rest and is the one place that walks them all: what has not started (a drain
hands it back), what runs or is bound to run (a drain waits for it), what models and LoRA
adapters are in use (none may be evicted), what a revoke takes out wherever it waits
(`withdraw`), and forgetting it all (a connection loss).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from typing import Any

from app.worker.lifecycle.replies import Delivery
from batching.feeder import Feeder
from batching.pool import lora_key
from batching.scheduler import Scheduler
from tasks.envelope import Annotations

FETCHING, PARKED, SCHEDULED, RUNNING, WAITING, GENERATING = (
    "fetching", "parked", "scheduled", "running", "waiting", "generating")


@dataclass(slots=True)
class Held:
    """A delivered request not yet settled, and what the dispatcher knows about it."""

    delivery: Delivery  # the message it came in (with others, if coalesced)
    task_id: str
    annotations: Annotations
    body: bytes  # its Celery body, decoded only on the runtime's thread
    returns: int = 0  # times a worker handed it on (republished) before
    started: float = 0.0  # epoch seconds when its batch started
    split: Split | None = None  # set on each part of a request run in parts
    part: int = 0  # which part
    # Its claim-checked inputs by key, once fetched (`body` keeps the claims: a request
    # given back must carry them, never the bytes); put in place by `decode_requests`.
    blobs: dict[str, bytes] | None = None
    # With tracing on (`app.worker.lifecycle.traces`): its `request` span until it is
    # settled, and the trace context of the batch it runs in, for the runtime's spans.
    span: Any = None
    batch_trace: str | None = None


@dataclass(slots=True)
class Split:
    """A request run as parts, one at a time; answered once, when all are done (how it is
    cut and put back together: `app.worker.lifecycle.splits`). Here, beside `Held`, as each
    part's `Held` points at it and it makes each part's `Held`."""

    parts: list[tuple[Annotations, bytes]]  # each part's annotations and Celery body
    alone_s: float = 0.0  # all its parts, run one after another, as a refusal may rely on
    results: list[dict[str, Any]] = field(default_factory=list)  # of the parts done
    inference_ms: float = 0.0  # summed over the parts' batches
    answered: bool = False

    def part_held(self, whole: Held, index: int) -> Held:
        annotations, body = self.parts[index]
        return Held(whole.delivery, whole.task_id, annotations, body, whole.returns,
                    whole.started, self, index, whole.blobs, whole.span)

    def describe(self, index: int) -> str:
        first = sum(a.items for a, _ in self.parts[:index])
        last = first + self.parts[index][0].items - 1
        items = f"item {first}" if first == last else f"items {first}-{last}"
        return f"{items} (part {index + 1} of {len(self.parts)})"


class Holdings:
    """Every request this worker holds, by state. Owns the requests fetching their claims
    and those parked for a LoRA adapter; reads the scheduler's lanes and batches and the
    feeder's queues."""

    def __init__(self, scheduler: Scheduler, feeder: Feeder) -> None:
        self.scheduler = scheduler
        self.feeder = feeder
        # Requests waiting for a LoRA adapter to load (and its model first), with their
        # delivery counts; they join the scheduler when it is loaded.
        self.parked: dict[tuple[str, str], list[tuple[Held, int]]] = {}
        # Requests whose claimed inputs are being fetched (not yet in the scheduler).
        self.fetching: dict[int, tuple[str, Held]] = {}

    # --- claims being fetched ------------------------------------------------------------

    def fetch(self, model: str, held: Held) -> None:
        self.fetching[id(held)] = (model, held)

    def fetched(self, held: Held) -> bool:
        """Its inputs came: False if it is no longer held (handed back meanwhile)."""
        return self.fetching.pop(id(held), None) is not None

    # --- parked for a LoRA adapter -------------------------------------------------------

    def park(self, model: str, lora: str, held: Held, deliveries: int) -> None:
        self.parked.setdefault((model, lora), []).append((held, deliveries))

    def unpark(self, model: str, lora: str) -> list[tuple[Held, int]]:
        """The requests parked for this adapter (removed), with their delivery counts."""
        return self.parked.pop((model, lora), [])

    def parked_loras(self, model: str) -> list[str]:
        """The adapters of `model` that requests are parked for."""
        return [lora for (parked_model, lora) in self.parked if parked_model == model]

    def expire_parked(self, now_ms: float) -> tuple[list[tuple[str, Held]], float | None]:
        """The parked requests whose deadline passed (removed), with their models, and the
        next deadline among those left (epoch ms), or None."""
        expired: list[tuple[str, Held]] = []
        soonest: float | None = None
        for key, waiting in list(self.parked.items()):
            kept = []
            for held, deliveries in waiting:
                deadline = held.annotations.deadline_ms
                if deadline is not None and deadline <= now_ms:
                    expired.append((key[0], held))
                    continue
                kept.append((held, deliveries))
                if deadline is not None:
                    soonest = deadline if soonest is None else min(soonest, deadline)
            if kept:
                self.parked[key] = kept
            else:
                del self.parked[key]
        return expired, soonest

    # --- every state -----------------------------------------------------------------------

    def states(self) -> Iterator[tuple[str, str, Held]]:
        """Every request held here: (its state, its model, it)."""
        for (model, held) in self.fetching.values():
            yield FETCHING, model, held
        for (model, _), waiting in self.parked.items():
            for held, _ in waiting:
                yield PARKED, model, held
        for model, lane in self.scheduler.lanes.items():
            for pending in lane.backlog:
                yield SCHEDULED, model, pending.handle
        for batch in self.scheduler.in_flight:
            for pending in batch.members:
                yield RUNNING, batch.lane.model, pending.handle
        for model, queue in self.feeder.waiting.items():
            for waiting in queue:
                yield WAITING, model, waiting.handle
        for model, in_flight in self.feeder.in_flight.items():
            for handle in in_flight.values():
                yield GENERATING, model, handle

    def running_ids(self) -> set[str]:
        """The task ids of the requests that run here: in a batch in flight, or handed to
        a continuous runtime."""
        return {held.task_id for state, _, held in self.states()
                if state in (RUNNING, GENERATING)}

    def counts(self) -> Counter[tuple[str, str]]:
        """How many requests are held, by (model, state)."""
        return Counter((model, state) for state, model, _ in self.states())

    def not_started(self, model: str) -> list[Held]:
        """Take out every request of `model` held here that has not started: in the
        backlog (but the later parts of a split request whose first part ran: it is
        answered once all have), waiting for a LoRA adapter or a continuous runtime's
        room, or for its claimed inputs."""
        back: list[Held] = []
        for pending in self.scheduler.drop(model):
            if pending.handle.part > 0:
                self.scheduler.append(model, pending)
            else:
                back.append(pending.handle)
        for key in [k for k in self.parked if k[0] == model]:
            back += [held for held, _ in self.parked.pop(key)]
        back += [waiting.handle for waiting in self.feeder.drop(model)]
        for key, (fetch_model, held) in list(self.fetching.items()):
            if fetch_model == model:
                del self.fetching[key]
                back.append(held)
        return back

    def withdraw(self, task_ids: Container[str]) -> list[tuple[str, Held]]:
        """Take out the requests with these ids that have not started (revoked), wherever
        they wait, with their models: the scheduler's backlog (a split request's later
        parts too), the continuous runtime's queue, a LoRA's parking, a claims' fetch."""
        out: list[tuple[str, Held]] = []
        for model, lane in self.scheduler.lanes.items():
            if lane.backlog:
                out += [(model, p.handle) for p in self.scheduler.release(model, task_ids)]
        for model, queue in self.feeder.waiting.items():
            if queue:
                out += [(model, w.handle) for w in self.feeder.release(model, task_ids)]
        for key, waiting in list(self.parked.items()):
            kept = [(h, d) for h, d in waiting if h.task_id not in task_ids]
            if len(kept) < len(waiting):
                out += [(key[0], h) for h, _ in waiting if h.task_id in task_ids]
                if kept:
                    self.parked[key] = kept
                else:
                    del self.parked[key]
        for key, (model, held) in list(self.fetching.items()):
            if held.task_id in task_ids:  # its fetch's end finds it gone (`fetched`)
                del self.fetching[key]
                out.append((model, held))
        return out

    @property
    def unfinished(self) -> int:
        """Requests running or bound to run here: the running batch, the parts of split
        requests left to run, the requests a continuous runtime is generating."""
        return (sum(len(batch.members) for batch in self.scheduler.in_flight)
                + sum(len(lane.backlog) for lane in self.scheduler.lanes.values())
                + sum(len(in_flight) for in_flight in self.feeder.in_flight.values()))

    @property
    def empty(self) -> bool:
        """Nothing held in any state."""
        return (self.unfinished == 0 and not self.parked and not self.fetching
                and not any(self.feeder.waiting.values()))

    def in_use(self) -> Counter[str]:
        """Models and LoRA adapters (`lora_key`) that requests held, parked or running
        need, with how many: none of them may be evicted, and the queued load with the
        most requests waiting goes first."""
        used: Counter[str] = Counter()
        pendings = [p for lane in self.scheduler.lanes.values() for p in lane.backlog]
        pendings += [p for batch in self.scheduler.in_flight for p in batch.members]
        for pending in pendings:
            a = pending.handle.annotations
            used[a.model] += 1
            if a.lora is not None:
                used[lora_key(a.model, a.lora)] += 1
        for (model, lora), waiting in self.parked.items():
            used[model] += len(waiting)
            used[lora_key(model, lora)] += len(waiting)
        used.update(self.feeder.counts())
        return used

    def clear(self) -> None:
        """Forget every held request (a connection loss: the broker redelivers them)."""
        self.scheduler.clear()
        self.parked.clear()
        self.feeder.clear()
        self.fetching.clear()

