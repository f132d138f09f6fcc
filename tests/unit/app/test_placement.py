"""The worker's placement: loads queue, evict when they start, and never-fitting is told
apart from not-fitting-yet. A runtime that loads in memory stands in for the real one
(tests/runtime/test_lazy_loading.py runs the real one); loop callbacks run when the
test drains them, as the event loop would run them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from app.worker.lifecycle.placement import Placement
from runtimes.worker_side.pool import Pool
from tasks.pool_state import COLD, LOADING, RESIDENT

MB = 2**20


class MemoryRuntime:
    """Loads take no time but wait for the test's go-ahead; every call is recorded."""

    def __init__(self, sizes: dict[str, int], resident: dict[str, int] | None = None) -> None:
        self.sizes = sizes
        self.resident = dict(resident or {})
        self.device_bytes = None
        self.calls: list[tuple[str, str]] = []
        self.go = threading.Semaphore(0)

    def estimate_bytes(self, model: str, lora: str | None = None) -> int:
        return self.sizes[model]

    def load(self, model: str, lora: str | None = None) -> int:
        self.go.acquire(timeout=10)
        self.calls.append(("load", model))
        self.resident[model] = self.sizes[model]
        return self.sizes[model]

    def unload(self, model: str, lora: str | None = None) -> None:
        self.calls.append(("unload", model))
        self.resident.pop(model, None)


class Loop:
    def __init__(self) -> None:
        self.callbacks: list[tuple[Callable[..., Any], tuple]] = []
        self.ready = threading.Condition()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        with self.ready:
            self.callbacks.append((fn, args))
            self.ready.notify_all()

    def run_one(self) -> None:
        with self.ready:
            assert self.ready.wait_for(lambda: self.callbacks, timeout=10), "no callback came"
            fn, args = self.callbacks.pop(0)
        fn(*args)


def _placement(runtime: MemoryRuntime, budget: int, in_use: set[str],
               pinned: set[str] = frozenset()) -> tuple[Placement, Loop, list, list]:
    """`in_use`: what requests wait for or run on, as the dispatcher would say."""
    loop, states, failures = Loop(), [], []
    placement = Placement(runtime, Pool(budget), list(runtime.sizes), set(pinned),
                          loop.call_soon, lambda: dict.fromkeys(in_use, 1),
                          lambda m, s: states.append((m, s)),
                          lambda m, why: failures.append((m, why)))
    return placement, loop, states, failures


def test_queued_loads_evict_when_they_start_not_when_they_are_asked_for():
    runtime = MemoryRuntime({"a": 100 * MB, "b": 100 * MB, "c": 100 * MB, "d": 100 * MB},
                            resident={"a": 100 * MB, "b": 100 * MB})
    waiting = {"c", "d"}  # requests wait for c and d
    placement, loop, states, failures = _placement(runtime, 250 * MB, in_use=waiting)
    placement.touch("b")  # a is the least recently used
    assert placement.ensure("c") is None and placement.ensure("d") is None
    # Only c's load runs; it evicted a alone, d waits without evicting anything yet.
    assert placement.state("a") == COLD and placement.state("b") == RESIDENT
    assert placement.state("c") == LOADING and placement.state("d") == LOADING
    assert ("d", LOADING) in states and ("b", COLD) not in states
    runtime.go.release()
    loop.run_one()  # c loaded; d starts now and evicts b, the least recently used
    assert placement.state("c") == RESIDENT and placement.state("b") == COLD
    runtime.go.release()
    loop.run_one()
    assert placement.state("d") == RESIDENT and not failures
    assert runtime.calls == [("unload", "a"), ("load", "c"), ("unload", "b"), ("load", "d")]


def test_a_load_that_does_not_fit_yet_waits_and_one_that_never_fits_is_refused():
    runtime = MemoryRuntime({"pinned": 100 * MB, "busy": 100 * MB, "next": 100 * MB,
                             "huge": 200 * MB},
                            resident={"pinned": 100 * MB, "busy": 100 * MB})
    in_use = {"busy", "next"}
    placement, loop, _, failures = _placement(runtime, 250 * MB, in_use, pinned={"pinned"})
    # Bigger than the budget left beside the pinned model: refused at once, with why.
    why = placement.ensure("huge")
    assert why is not None and "does not fit" in why and "pinned" in why
    # Fits once `busy` is done with: queued, nothing evicted, nothing refused.
    assert placement.ensure("next") is None
    assert placement.state("next") == LOADING and placement.state("busy") == RESIDENT
    assert runtime.calls == []
    in_use.discard("busy")  # the batch of `busy` ended
    placement.kick()
    runtime.go.release()
    loop.run_one()
    assert placement.state("next") == RESIDENT and placement.state("busy") == COLD
    assert placement.state("pinned") == RESIDENT and not failures


def test_a_queued_load_nobody_waits_for_any_more_is_dropped_unless_an_operator_asked():
    runtime = MemoryRuntime({"a": 100 * MB, "b": 100 * MB, "c": 100 * MB})
    waiting = {"a", "b", "c"}
    placement, loop, states, _ = _placement(runtime, 1000 * MB, in_use=waiting)
    placement.ensure("a")
    placement.ensure("b")
    placement.ensure("c", asked=True)
    waiting.clear()  # b's and c's requests were answered at their deadlines
    runtime.go.release()
    loop.run_one()  # a loaded; b is dropped, c loads (an operator asked)
    assert placement.state("b") == COLD and ("b", COLD) in states
    runtime.go.release()
    loop.run_one()
    assert placement.state("c") == RESIDENT
    assert [m for op, m in runtime.calls if op == "load"] == ["a", "c"]
