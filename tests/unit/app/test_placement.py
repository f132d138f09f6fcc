"""The worker's placement: loads queue, evict when they start, and never-fitting is told
apart from not-fitting-yet. A runtime that loads in memory stands in for the real one
(tests/runtime/test_lazy_loading.py runs the real one); loop callbacks run when the
test drains them, as the event loop would run them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from app.worker.lifecycle.placement import Placed, Placement
from batching.pool import Pool
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

    def placed(event: Placed) -> None:  # the loop's one placement event, recorded
        if event.lora is not None:
            return
        states.append((event.model, event.state))
        if event.why is not None:  # a model's load failed (not an adapter's)
            failures.append((event.model, event.why))

    placement = Placement(runtime, Pool(budget), list(runtime.sizes), set(pinned),
                          loop.call_soon, lambda: dict.fromkeys(in_use, 1), placed)
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


# --- the fleet's plan (SHOAL_PLACEMENT=fleet) -------------------------------------------------


def _follow(placement: Placement, keep: set[str], rates: dict[str, float]) -> None:
    from batching.fleet import Demand, Plan

    placement.follow(Plan({"me": frozenset(keep)}, {}), "me",
                     {m: Demand(rate=r, load_s=1.0) for m, r in rates.items()})


def test_the_fleet_keeps_its_kept_models_and_evicts_the_cheapest_swapped_one():
    sizes = {m: 100 * MB for m in "abcd"}
    runtime = MemoryRuntime(sizes, resident={"a": 100 * MB, "b": 100 * MB, "c": 100 * MB})
    placement, loop, _, _ = _placement(runtime, 350 * MB, in_use={"d"})
    _follow(placement, keep={"a"}, rates={"a": 0.1, "b": 5.0, "c": 1.0, "d": 0.5})
    placement.touch("c")  # c and d are the most recently used: LRU would evict a
    placement.touch("d")
    assert placement.ensure("d") is None
    # a is kept (though the least asked for and the least recent), c's absence is the
    # cheapest of the rest
    assert placement.state("a") == RESIDENT and placement.state("b") == RESIDENT
    assert placement.state("c") == COLD
    runtime.go.release()
    loop.run_one()
    assert placement.state("d") == RESIDENT


def test_a_swapped_model_that_is_not_kept_cannot_evict_a_kept_one():
    sizes = {m: 100 * MB for m in "abc"}
    runtime = MemoryRuntime(sizes, resident={"a": 100 * MB, "b": 100 * MB})
    placement, _, _, _ = _placement(runtime, 250 * MB, in_use={"c"})
    _follow(placement, keep={"a", "b"}, rates={"a": 1.0, "b": 1.0, "c": 50.0})
    assert placement.ensure("c") is None
    assert placement.state("c") == LOADING  # queued: it waits for room, evicting nothing
    assert placement.state("a") == RESIDENT and placement.state("b") == RESIDENT
    assert runtime.calls == []


def test_a_swapped_model_past_its_turn_gives_way_and_queues_again_for_its_waiting_requests():
    sizes = {m: 100 * MB for m in "abc"}
    runtime = MemoryRuntime(sizes, resident={"a": 100 * MB})
    waiting = {"b", "c"}  # both have requests waiting, all the time (a saturated worker)
    placement, loop, states, _ = _placement(runtime, 250 * MB, in_use=waiting)
    _follow(placement, keep={"a"}, rates={"a": 5.0, "b": 1.0, "c": 1.0})
    placement.load_s = {"b": 0.0, "c": 0.0}  # so that a turn is TURN_S
    assert placement.ensure("b") is None
    runtime.go.release()
    loop.run_one()
    assert placement.state("b") == RESIDENT
    assert placement.ensure("c") is None
    assert placement.state("c") == LOADING and placement.state("b") == RESIDENT  # b's turn
    placement.loaded_at["b"] -= 2.0  # its turn is over
    placement.kick()
    assert placement.state("b") == LOADING  # evicted for c, and queued again: requests wait
    assert ("b", COLD) not in states
    runtime.go.release()
    loop.run_one()
    assert placement.state("c") == RESIDENT
