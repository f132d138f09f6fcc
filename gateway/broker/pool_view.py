"""What the gateway knows of the workers' model pools: the latest state each worker sent.

Workers publish `tasks.pool_state` messages on a fanout exchange; the broker
hands every one to this gateway's own queue (`gateway.broker.served_models`), and this
module keeps the latest per worker. A worker not heard from for
`STALE_AFTER_INTERVALS` of its own `interval_s` is forgotten. Nothing here
does I/O or reads a clock: `now` (monotonic seconds, when the message
arrived or the question is asked) is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tasks.pool_state import COLD, LOADING, RESIDENT, STALE_AFTER_INTERVALS, decode_state

STATES = (RESIDENT, LOADING, COLD)


@dataclass(frozen=True, slots=True)
class Placement:
    """One model on one worker."""

    worker: str
    state: str  # resident | loading | cold
    bytes: int | None
    pinned: bool
    loras: tuple[str, ...]  # the LoRA adapters the worker has loaded for it
    device_busy: float | None = None  # the worker's device, busy fraction (None: not said)
    # Its runtime refuses the model's requests while a failed restart's replacement starts:
    # seconds (from when the state was sent) until it should serve. None: it serves.
    ready_in_s: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerState:
    worker: str
    heard_at: float  # monotonic, when the message arrived here
    stale_after_s: float
    models: dict[str, Placement]


def parse_state(body: bytes, default_interval_s: float, now: float) -> WorkerState:
    """A worker's message checked field by field; ValueError names what is wrong."""
    state = decode_state(body)
    interval = state.get("interval_s", default_interval_s)
    if isinstance(interval, bool) or not isinstance(interval, int | float) \
            or not math.isfinite(interval) or interval <= 0:
        raise ValueError(f"interval_s must be a positive number, got {interval!r}")
    worker = state["worker"]
    busy = state.get("device_busy")
    if busy is not None and (isinstance(busy, bool) or not isinstance(busy, int | float)
                             or not math.isfinite(busy) or busy < 0):
        raise ValueError(f"device_busy must be a number >= 0 or absent, got {busy!r}")
    models: dict[str, Placement] = {}
    for i, m in enumerate(state["models"]):
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            raise ValueError(f"models[{i}] must be a map with a string 'id'")
        if m.get("state") not in STATES:
            raise ValueError(f"models[{i}].state must be one of {list(STATES)}, "
                             f"got {m.get('state')!r}")
        size = m.get("bytes")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise ValueError(f"models[{i}].bytes must be an integer or null")
        pinned = m.get("pinned", False)
        if not isinstance(pinned, bool):
            raise ValueError(f"models[{i}].pinned must be a boolean")
        loras = m.get("loras") or []
        if not isinstance(loras, list) or not all(isinstance(name, str) for name in loras):
            raise ValueError(f"models[{i}].loras must be a list of strings")
        ready_in = m.get("ready_in_s")
        if ready_in is not None and (isinstance(ready_in, bool)
                                     or not isinstance(ready_in, int | float)
                                     or not math.isfinite(ready_in) or ready_in < 0):
            raise ValueError(f"models[{i}].ready_in_s must be a number >= 0 or absent")
        models[m["id"]] = Placement(worker, m["state"], size, pinned, tuple(loras),
                                    None if busy is None else float(busy),
                                    None if ready_in is None else float(ready_in))
    return WorkerState(worker, now, STALE_AFTER_INTERVALS * float(interval), models)


class PoolView:
    """The latest state of every worker heard from recently."""

    def __init__(self, default_interval_s: float) -> None:
        self.default_interval_s = default_interval_s
        self._workers: dict[str, WorkerState] = {}
        # Workers that went stale (a killed one): a stream they served has ended. Bounded by
        # the fleet's history of worker names, which `shoal worker` keeps per host.
        self._forgotten: set[str] = set()
        self._served_until: dict[str, float] = {}  # `serves`' last answers, by model

    def update(self, body: bytes, now: float) -> WorkerState:
        """Keep a worker's message (ValueError, and nothing kept, if it is malformed)."""
        state = parse_state(body, self.default_interval_s, now)
        self._workers[state.worker] = state
        self._served_until.clear()  # a worker may have stopped serving a model
        return state

    def fresh(self, now: float) -> list[WorkerState]:
        """Workers heard from within their staleness limit, by name; forgets the others."""
        stale = [w for w, s in self._workers.items() if now - s.heard_at > s.stale_after_s]
        for worker in stale:
            del self._workers[worker]
            self._forgotten.add(worker)
        return sorted(self._workers.values(), key=lambda s: s.worker)

    def gone(self, worker: str, now: float) -> bool:
        """Whether a worker this view has heard from has since left: it said farewell (a
        state with no models) or went stale. False for one never heard from."""
        state = self._workers.get(worker)
        if state is None:
            return worker in self._forgotten
        if now - state.heard_at > state.stale_after_s:
            del self._workers[worker]
            self._forgotten.add(worker)
            return True
        return not state.models

    def placements(self, model: str, now: float) -> list[Placement]:
        """Where `model` is, in any state, on fresh workers, by worker name."""
        return [s.models[model] for s in self.fresh(now) if model in s.models]

    def serves(self, model: str, now: float) -> bool:
        """Whether a fresh worker says it serves (consumes the queue of) `model`. Asked on
        every request: a dictionary lookup while the last answer holds (until the freshest
        such worker would go stale, or a state arrives); no sorting, no pruning."""
        if now <= self._served_until.get(model, float("-inf")):
            return True
        until = max((s.heard_at + s.stale_after_s for s in self._workers.values()
                     if model in s.models), default=float("-inf"))
        self._served_until[model] = until
        return now <= until


def worker_rows(placements: list[Placement], lora: str | None = None) -> list[dict[str, Any]]:
    """The `workers` field of a /v1/models entry. A base model's row adds the LoRAs that
    worker has loaded for it and how busy its device was lately (None: not said). A
    LoRA's row is `resident` where the worker has the base resident with that adapter
    loaded, else the base's state (`cold` when the base is resident but the adapter is not
    loaded); its bytes are unknown here (None)."""
    rows = []
    for p in placements:
        if lora is None:
            rows.append({"worker": p.worker, "state": p.state, "bytes": p.bytes,
                         "pinned": p.pinned, "loras": list(p.loras),
                         "device_busy": p.device_busy})
            continue
        state = COLD if p.state == RESIDENT and lora not in p.loras else p.state
        rows.append({"worker": p.worker, "state": state, "bytes": None, "pinned": False})
    return rows
