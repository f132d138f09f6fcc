"""Requests for a continuously batching runtime (SGLang): handed over one by one.

Such a runtime forms its own batches, adding a request to the running ones at its
next step, so the worker forms none: it hands each request over as soon as the
runtime has room for it (a free running slot, KV-cache tokens left) and keeps
the rest here, in arrival order, without decoding them. What waits here the
broker could give to another worker instead, so a request that has waited
`return_after_s` while a peer consumes the same queue goes back (requeued, as
the scheduler's returns); one whose deadline passes here is answered
DEADLINE_EXCEEDED. This module decides; `app.worker.lifecycle.dispatcher` applies.

Pure logic: no broker, no runtime, no clock of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Hashable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Load:
    """What a continuously batching runtime holds for one model now, and its bounds."""

    running: int  # requests being decoded
    waiting: int  # requests accepted but not yet running
    max_running: int  # the most it decodes at once
    tokens: int = 0  # KV-cache tokens in use
    max_tokens: int = 0  # the KV cache's size (0: unknown)

    @property
    def saturated(self) -> bool:
        """More work would only wait inside the runtime (where no peer can take it)."""
        full_cache = self.max_tokens > 0 and self.tokens >= self.max_tokens
        return self.waiting > 0 or self.running >= self.max_running or full_cache


@dataclass(slots=True)
class Waiting:
    """A request held for a continuous runtime, not yet handed over."""

    handle: Any  # the dispatcher's Held
    received: float  # monotonic
    deadline: float | None  # monotonic
    deliveries: int  # times the broker delivered it (returns count too)
    key: str | None = None  # its id: the in-flight requests are told apart by it


def room(load: Load, in_flight: int) -> int:
    """How many more requests the runtime should take now: free running slots, counting
    those handed over that it may not report yet; none while its KV cache is full."""
    if load.max_tokens > 0 and load.tokens >= load.max_tokens:
        return 0
    return max(0, load.max_running - max(in_flight, load.running + load.waiting))


class Feeder:
    def __init__(self, return_after_s: float, delivery_limit: int) -> None:
        self.return_after_s = return_after_s
        self.delivery_limit = delivery_limit
        self.waiting: dict[str, deque[Waiting]] = {}
        self.in_flight: dict[str, dict[str, Any]] = {}  # model -> task id -> handle

    def add(self, model: str, waiting: Waiting) -> None:
        self.waiting.setdefault(model, deque()).append(waiting)

    def take(self, model: str, load: Load) -> list[Waiting]:
        """The requests to hand over now, oldest first. One whose id is in flight, or
        taken before it, waits: the runtime tells requests apart by id, and two may share
        one (republished by a gateway after a reconnect)."""
        queue = self.waiting.get(model)
        if not queue:
            return []
        n = room(load, len(self.in_flight.get(model, ())))
        running = self.in_flight.get(model, {})
        taken: list[Waiting] = []
        ids: set[str] = set()
        kept: deque[Waiting] = deque()
        for w in queue:
            if len(taken) < n and (w.key is None or (w.key not in running
                                                     and w.key not in ids)):
                taken.append(w)
                if w.key is not None:
                    ids.add(w.key)
            else:
                kept.append(w)
        self.waiting[model] = kept
        return taken

    def started(self, model: str, task_id: str, handle: Any) -> None:
        self.in_flight.setdefault(model, {})[task_id] = handle

    def done(self, model: str, task_id: str) -> None:
        self.in_flight.get(model, {}).pop(task_id, None)

    def expired(self, now: float) -> list[tuple[str, Waiting]]:
        """Waiting requests whose deadline passed (removed)."""
        out: list[tuple[str, Waiting]] = []
        for model, queue in self.waiting.items():
            late = [w for w in queue if w.deadline is not None and w.deadline <= now]
            for w in late:
                queue.remove(w)
                out.append((model, w))
        return out

    def returns(self, model: str, now: float, peers: int) -> list[Waiting]:
        """Requests to give back: waited `return_after_s` here while another worker consumes
        the queue, and far enough from the delivery limit (removed)."""
        queue = self.waiting.get(model)
        if not queue or peers <= 1:
            return []
        limit = self.delivery_limit
        back = [w for w in queue if now - w.received >= self.return_after_s
                and (limit < 0 or w.deliveries <= limit // 2)]
        for w in back:
            queue.remove(w)
        return back

    def release(self, model: str, keys: Container[Hashable]) -> list[Waiting]:
        """The waiting requests of the model with these keys (removed): revoked."""
        queue = self.waiting.get(model)
        released = [w for w in queue if w.key in keys] if queue else []
        for w in released:
            queue.remove(w)  # type: ignore[union-attr]
        return released

    def drop(self, model: str) -> list[Waiting]:
        """Every waiting request of the model (removed): its load failed."""
        return list(self.waiting.pop(model, ()))

    def wake_in(self, now: float, peers: dict[str, int]) -> float | None:
        """Seconds until the next deadline or return among the waiting requests."""
        times = []
        for model, queue in self.waiting.items():
            for w in queue:
                if w.deadline is not None:
                    times.append(w.deadline)
                if peers.get(model, 1) > 1:
                    times.append(w.received + self.return_after_s)
        return None if not times else max(0.0, min(times) - now)

    def counts(self) -> dict[str, int]:
        """Requests held per model, waiting or handed over (none may be evicted)."""
        models = set(self.waiting) | set(self.in_flight)
        return {m: len(self.waiting.get(m, ())) + len(self.in_flight.get(m, {})) for m in models}

    def clear(self) -> None:
        self.waiting.clear()
        self.in_flight.clear()
