"""The host-memory tier (issue 51): models evicted from the device, kept in host memory
under a byte budget, so that loading one again is a copy back, not a read and build from
disk.

Pure bookkeeping, no torch and no clock: what is kept is whatever the caller puts (the
model host keeps adapters whose weights its engine moved to host memory,
`runtimes.child_side.host`; the sim keeps a marker, `runtimes.doubles.sim.runtime`).
Entries go least recently kept first when a new one needs room; the bytes kept never
pass the budget, and one larger than the budget alone is not kept at all. A budget of 0
keeps nothing. Thread-safe: unloads and loads may come from different threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class HostTier(Generic[T]):
    """Kept values by key, each with its host bytes, oldest first.

    Counters (read by tests, benchmarks and logs): `hits` (takes that found their key),
    `misses` (takes that did not, while the tier is on), `kept` (puts that kept their
    value), `evicted` (values dropped to make room for a newer one), `refused` (puts
    too large for the budget)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the host tier's budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self._entries: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.kept = 0
        self.evicted = 0
        self.refused = 0

    @property
    def on(self) -> bool:
        return self.budget > 0

    @property
    def used(self) -> int:
        """The host bytes of what is kept."""
        return self._used

    def fits(self, nbytes: int) -> bool:
        """Whether a value of `nbytes` can be kept at all (after evicting every other)."""
        return self.on and 0 <= nbytes <= self.budget

    def put(self, key: str, value: T, nbytes: int) -> list[tuple[str, T]]:
        """Keep `value` as the most recent, evicting the oldest kept ones until it fits
        (a value already kept under `key` is replaced). Returns what was dropped, oldest
        first, for the caller to free: the evicted values, or `(key, value)` itself when
        it is larger than the budget (nothing else is evicted then)."""
        with self._lock:
            dropped: list[tuple[str, T]] = []
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old[1]
                dropped.append((key, old[0]))
            if not self.fits(nbytes):
                self.refused += 1
                dropped.append((key, value))
                return dropped
            while self._used + nbytes > self.budget:
                oldest, (kept, size) = self._entries.popitem(last=False)
                self._used -= size
                self.evicted += 1
                dropped.append((oldest, kept))
            self._entries[key] = (value, nbytes)
            self._used += nbytes
            self.kept += 1
            return dropped

    def take(self, key: str) -> T | None:
        """The value kept under `key`, no longer kept (None if there is none)."""
        with self._lock:
            found = self._entries.pop(key, None)
            if found is None:
                if self.on:
                    self.misses += 1
                return None
            self._used -= found[1]
            self.hits += 1
            return found[0]

    def discard(self, key: str) -> T | None:
        """Forget `key` without counting a hit or a miss; its value, if there was one."""
        with self._lock:
            found = self._entries.pop(key, None)
            if found is None:
                return None
            self._used -= found[1]
            return found[0]

    def clear(self) -> list[tuple[str, T]]:
        """Forget everything: what was kept, oldest first."""
        with self._lock:
            dropped = [(k, v) for k, (v, _) in self._entries.items()]
            self._entries.clear()
            self._used = 0
            return dropped

    def keys(self) -> list[str]:
        """The kept keys, oldest first."""
        with self._lock:
            return list(self._entries)

    def bytes_of(self, key: str) -> int | None:
        with self._lock:
            found = self._entries.get(key)
            return None if found is None else found[1]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __iter__(self) -> Iterator[str]:
        """The kept keys, oldest first (a snapshot)."""
        return iter(self.keys())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
