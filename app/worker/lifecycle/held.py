"""What a worker holds: every delivered request not yet settled, and in which state.

A request is held from its delivery until it is answered or handed back. Its state is on
it (`Held.state`), set only by `Holdings`' transitions, which also put it where it waits:

- FETCHING (`fetch`): its claim-checked inputs are being fetched
  (`app.worker.lifecycle.claims`); it enters the scheduler only once they are here
  (`fetched`: RECEIVED again).
- PARKED (`park`): it waits for its LoRA adapter to load (and its model first), outside
  the scheduler; it joins the scheduler when the adapter is loaded (`unpark`).
- SCHEDULED (`schedule`): in its model's lane (`batching.scheduler`), waiting for a batch;
  RUNNING (`run`): in a batch in flight.
- WAITING (`wait`): held for a continuously batching runtime (`batching.feeder`) until it
  has room; GENERATING (`generate`): handed to that runtime.
- SETTLED (`settle`): answered or handed back; no longer held.

The scheduler and the feeder keep their own queues (they decide on them); `Holdings`
keeps every held request in one registry (`held`) besides, so what is held in which
state, what runs, which models and LoRA adapters are in use, and whether anything is held
are read from it, not rebuilt from the queues. What it takes out of the queues (a drain's
hand-back, a revoke's `withdraw`, the parked requests whose deadline passed) it settles.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from app.worker.lifecycle.replies import Delivery
from batching.feeder import Feeder, Waiting
from batching.lanes import Batch
from batching.pool import lora_key
from batching.scheduler import Scheduler
from batching.shapes import Pending
from tasks.envelope import Annotations

RECEIVED, FETCHING, PARKED, SCHEDULED, RUNNING, WAITING, GENERATING, SETTLED = (
    "received", "fetching", "parked", "scheduled", "running", "waiting", "generating",
    "settled")
# Running or bound to run here: a drain waits for them.
UNFINISHED = frozenset({SCHEDULED, RUNNING, GENERATING})
# Held in the scheduler or parked: their LoRA adapter may not be evicted.
USING_LORA = frozenset({PARKED, SCHEDULED, RUNNING})


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
    state: str = RECEIVED  # where it is in its life here: `Holdings`' transitions set it


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
    """Every request this worker holds, in its state (see the module). Owns the requests
    fetching their claims and those parked for a LoRA adapter; puts the others in the
    scheduler's lanes and the feeder's queues."""

    def __init__(self, scheduler: Scheduler, feeder: Feeder) -> None:
        self.scheduler = scheduler
        self.feeder = feeder
        # Every request held, by its id (the parts of a split request one at a time).
        self.held: dict[int, Held] = {}
        # Requests waiting for a LoRA adapter to load (and its model first), with their
        # delivery counts; they join the scheduler when it is loaded.
        self.parked: dict[tuple[str, str], list[tuple[Held, int]]] = {}
        # Requests whose claimed inputs are being fetched (not yet in the scheduler).
        self.fetching: dict[int, tuple[str, Held]] = {}

    # --- transitions -----------------------------------------------------------------------

    def fetch(self, model: str, held: Held) -> None:
        self.fetching[id(held)] = (model, held)
        held.state = FETCHING
        self.held[id(held)] = held

    def fetched(self, held: Held) -> bool:
        """Its inputs came: False if it is no longer held (handed back meanwhile)."""
        if self.fetching.pop(id(held), None) is None:
            return False
        held.state = RECEIVED
        return True

    def park(self, model: str, lora: str, held: Held, deliveries: int) -> None:
        self.parked.setdefault((model, lora), []).append((held, deliveries))
        held.state = PARKED
        self.held[id(held)] = held

    def unpark(self, model: str, lora: str) -> list[tuple[Held, int]]:
        """The requests parked for this adapter (out of the parking, still held: each is
        scheduled or settled next), with their delivery counts."""
        out = self.parked.pop((model, lora), [])
        for held, _ in out:
            held.state = RECEIVED
        return out

    def schedule(self, model: str, pending: Pending) -> None:
        """Into its model's scheduler lane."""
        held: Held = pending.handle
        held.state = SCHEDULED
        self.held[id(held)] = held
        self.scheduler.append(model, pending)

    def wait(self, model: str, waiting: Waiting) -> None:
        """Into the continuous runtime's feeder."""
        held: Held = waiting.handle
        held.state = WAITING
        self.held[id(held)] = held
        self.feeder.add(model, waiting)

    def run(self, batch: Batch) -> None:
        """The scheduler started a batch: its requests run."""
        for pending in batch.members:
            pending.handle.state = RUNNING

    def generate(self, model: str, held: Held) -> None:
        """Handed to the continuous runtime (the feeder took it out of its queue)."""
        self.feeder.started(model, held.task_id, held)
        held.state = GENERATING

    def settle(self, held: Held) -> None:
        """Answered or handed back: no longer held."""
        self.held.pop(id(held), None)
        held.state = SETTLED

    def settle_all(self, helds: Iterable[Held]) -> None:
        for held in helds:
            self.held.pop(id(held), None)
            held.state = SETTLED

    # --- taken out wherever they wait (settled: the caller answers or hands them back) -----

    def parked_loras(self, model: str) -> list[str]:
        """The adapters of `model` that requests are parked for."""
        return [lora for (parked_model, lora) in self.parked if parked_model == model]

    def expire_parked(self, now_ms: float) -> tuple[list[tuple[str, Held]], float | None]:
        """The parked requests whose deadline passed (settled), with their models, and the
        next deadline among those left (epoch ms), or None."""
        expired: list[tuple[str, Held]] = []
        soonest: float | None = None
        for key, waiting in list(self.parked.items()):
            kept = []
            for held, deliveries in waiting:
                deadline = held.annotations.deadline_ms
                if deadline is not None and deadline <= now_ms:
                    expired.append((key[0], held))
                    self.settle(held)
                    continue
                kept.append((held, deliveries))
                if deadline is not None:
                    soonest = deadline if soonest is None else min(soonest, deadline)
            if kept:
                self.parked[key] = kept
            else:
                del self.parked[key]
        return expired, soonest

    def not_started(self, model: str) -> list[Held]:
        """Take out (settled) every request of `model` held here that has not started: in
        the backlog (but the later parts of a split request whose first part ran: it is
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
        self.settle_all(back)
        return back

    def withdraw(self, task_ids: Container[str]) -> list[tuple[str, Held]]:
        """Take out (settled) the requests with these ids that have not started (revoked),
        wherever they wait, with their models: the scheduler's backlog (a split request's
        later parts too), the continuous runtime's queue, a LoRA's parking, a claims'
        fetch."""
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
        self.settle_all(held for _, held in out)
        return out

    def clear(self) -> None:
        """Forget every held request (a connection loss: the broker redelivers them)."""
        self.scheduler.clear()
        self.parked.clear()
        self.feeder.clear()
        self.fetching.clear()
        self.held.clear()

    # --- read from the registry -----------------------------------------------------------

    def states(self) -> Iterator[tuple[str, str, Held]]:
        """Every request held here: (its state, its model, it)."""
        for held in self.held.values():
            yield held.state, held.annotations.model, held

    def running(self) -> list[Held]:
        """The requests that run here: in a batch in flight, or handed to a continuous
        runtime."""
        return [held for held in self.held.values() if held.state in (RUNNING, GENERATING)]

    def running_ids(self) -> set[str]:
        return {held.task_id for held in self.running()}

    def counts(self) -> Counter[tuple[str, str]]:
        """How many requests are held, by (model, state)."""
        return Counter((held.annotations.model, held.state) for held in self.held.values())

    @property
    def unfinished(self) -> int:
        """Requests running or bound to run here: the running batch, the parts of split
        requests left to run, the requests a continuous runtime is generating."""
        return sum(1 for held in self.held.values() if held.state in UNFINISHED)

    @property
    def empty(self) -> bool:
        """Nothing held in any state."""
        return not self.held

    def in_use(self) -> Counter[str]:
        """Models and LoRA adapters (`lora_key`) that requests held, parked or running
        need, with how many: none of them may be evicted, and the queued load with the
        most requests waiting goes first."""
        used: Counter[str] = Counter()
        for held in self.held.values():
            state = held.state
            if state in (FETCHING, RECEIVED):
                continue  # not placed yet: asks for nothing
            a = held.annotations
            used[a.model] += 1
            if a.lora is not None and state in USING_LORA:
                used[lora_key(a.model, a.lora)] += 1
        return used
