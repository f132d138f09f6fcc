"""The device memory pool: which models (and LoRA adapters) are resident, what they take,
and which to evict so that another fits.

Pure bookkeeping, no I/O and no clock: the worker (`app.worker.lifecycle.placement`) asks it
whether a
load may start and what must go first, and tells it what happened. Keys are model ids,
or `lora_key(model, lora)` for a LoRA adapter, which lives on its base model: evicting
the base evicts its adapters, and an adapter in use keeps its base.

Rules:
- a load is admitted only if, after evictions, the resident bytes plus every load in
  flight (at its estimate) fit the budget;
- pinned keys, keys in use (the caller names them: a running or held batch) and keys
  still loading are never evicted;
- the others go least recently used first (or, given an `order`, lowest first: the
  fleet's placement orders them by what their absence would cost), only as many as
  needed; if evicting all of them would still not make room, nothing is evicted and the
  load is refused. Keys the caller `protect`s are kept for that load as if in use.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

LORA_SEPARATOR = ":"


def lora_key(model: str, lora: str) -> str:
    return f"{model}{LORA_SEPARATOR}{lora}"


def keys_of(model: str, keys: Iterable[str]) -> list[str]:
    """Of `keys`, the model's own and those of its LoRA adapters: what unloading the
    model frees."""
    return [k for k in keys if k == model or k.startswith(model + LORA_SEPARATOR)]


class DoesNotFit(Exception):
    """A load that cannot fit the budget even after every eviction allowed."""


@dataclass(slots=True)
class Slot:
    key: str
    bytes: int  # measured once loaded; the estimate while loading
    pinned: bool = False
    loading: bool = False
    last_used: float = 0.0
    base: str | None = None  # a LoRA adapter's model


class Pool:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.slots: dict[str, Slot] = {}

    # --- what is there ---------------------------------------------------------------

    def used(self) -> int:
        return sum(s.bytes for s in self.slots.values())

    def resident(self, key: str) -> bool:
        slot = self.slots.get(key)
        return slot is not None and not slot.loading

    def loading(self, key: str) -> bool:
        slot = self.slots.get(key)
        return slot is not None and slot.loading

    def adapters_of(self, model: str) -> list[str]:
        return [k for k, s in self.slots.items() if s.base == model]

    # --- decisions -------------------------------------------------------------------

    def admit(self, key: str, estimate: int, now: float, in_use: Collection[str] = (),
              pinned: bool = False, base: str | None = None,
              order: Mapping[str, float] | None = None,
              protect: Collection[str] = ()) -> list[str]:
        """Reserve `estimate` bytes for loading `key`: the keys to evict first (least
        recently used first, or lowest in `order`; each evicted model takes its adapters
        along; `protect`ed keys stay). Raises DoesNotFit, changing nothing, when that
        cannot make room."""
        if key in self.slots:
            state = "loading" if self.slots[key].loading else "resident"
            raise ValueError(f"{key} is already {state}")
        free = self.budget - self.used() - estimate
        evict: list[str] = []
        if free < 0:
            kept = self._kept([*in_use, *protect], base)
            ranked = sorted(self.slots.values(), key=lambda s: s.last_used)
            if order is not None:
                ranked.sort(key=lambda s: order.get(s.key, 0.0))  # stable: LRU among equals
            for slot in ranked:
                if free >= 0:
                    break
                if slot.key in kept or slot.key in evict:
                    continue
                group = [slot.key, *self.adapters_of(slot.key)]
                if any(k in kept for k in group):
                    continue
                evict += group
                free += sum(self.slots[k].bytes for k in group)
            if free < 0:
                raise DoesNotFit(
                    f"{key} needs about {_mib(estimate)} and {_mib(self.budget)} of device "
                    f"memory is the budget: {_mib(self.budget - self.used())} free, and only "
                    f"{_mib(sum(self.slots[k].bytes for k in evict))} more could be freed "
                    f"(pinned, in use or loading: "
                    f"{sorted(self._kept([*in_use, *protect], base)) or 'none'})")
        for k in evict:
            del self.slots[k]
        self.slots[key] = Slot(key, estimate, pinned, True, now, base)
        return evict

    def _kept(self, in_use: Collection[str], base: str | None) -> set[str]:
        kept = {k for k, s in self.slots.items() if s.pinned or s.loading}
        kept.update(k for k in in_use if k in self.slots)
        # An adapter in use (or about to load) keeps its base model.
        kept.update(s.base for k, s in self.slots.items() if k in kept and s.base)
        if base is not None:
            kept.add(base)
        return kept

    # --- what happened -----------------------------------------------------------------

    def add(self, key: str, measured_bytes: int, now: float, pinned: bool = False) -> None:
        """A key that is resident already (loaded at start), fitting or not."""
        self.slots[key] = Slot(key, measured_bytes, pinned, False, now)

    def loaded(self, key: str, measured_bytes: int, now: float) -> None:
        slot = self.slots[key]
        slot.bytes, slot.loading, slot.last_used = measured_bytes, False, now

    def failed(self, key: str) -> None:
        """The load of `key` failed: its reservation is released."""
        self.slots.pop(key, None)

    def remove(self, key: str) -> list[str]:
        """Forget `key` (unloaded) and, for a model, its adapters: the keys removed."""
        if key not in self.slots:
            return []
        gone = [key, *self.adapters_of(key)]
        for k in gone:
            del self.slots[k]
        return gone

    def touch(self, key: str, now: float) -> None:
        slot = self.slots.get(key)
        if slot is not None:
            slot.last_used = now


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
