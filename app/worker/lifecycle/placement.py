"""Which models this worker holds: loads on first request, LRU evictions, pinned models.

The bookkeeping is `batching.pool.Pool`'s; this class drives it from the worker's event
loop thread and runs the loads and unloads on a thread of its own, beside the batches
of the models already loaded (the runtime takes them on a connection of their own), so
the event loop (and with it the broker heartbeats) never waits for a load.

Life of a model on a worker: cold -> loading -> resident -> (evicted) cold. A request
held for a model that is not resident starts its load at once; when it ends, a `Placed`
event tells the loop (the lane may run, the consumer's priority rises; or, with `why`,
every request held for it is answered MODEL_UNAVAILABLE with the reason). A LoRA adapter
is loaded the same way once its model is resident (its `Placed` names it), counts
against the same budget and is evicted LRU too (with its model, or alone). A failure is
remembered for `FAILURE_MEMORY_S`, and the requests that arrive meanwhile are answered
at once instead of each trying the load again.

Loads queue and run one at a time; each evicts what it needs when it starts. A load
that does not fit yet (what is in use or loading must end first) waits; one whose
requests are all gone by its turn (answered at their deadlines) is dropped.

What it evicts: with SHOAL_PLACEMENT=lru, the least recently used. With `fleet` (the
default), the fleet's plan decides (`follow`, from `batching.fleet`): the models this
worker keeps go last, and only for a model it keeps that is worth more; the rest (its
swap room) go cheapest first, by what their absence would cost (demand x reload time),
once nothing waits for them (the hysteresis is the plan's: what it keeps changes only
for a clearly busier model). Loads of the models it keeps go first; the swapped-in ones
in arrival order, so a rare model's wait is bounded by the models queued before it. It
counts what each model is asked for and how long its batches keep the device busy,
which the pool state publishes for the fleet's plan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from app.worker import metrics
from batching.fleet import Demand, DemandMeter, Plan, eviction_value
from batching.pool import LORA_SEPARATOR, DoesNotFit, Pool, lora_key
from runtimes.base import Runtime
from tasks.pool_state import COLD, LOADING, RESIDENT

log = logging.getLogger(__name__)

FAILURE_MEMORY_S = 10.0
DEFAULT_LOAD_S = 1.0
# The window of the demand each worker reports: short enough to follow a shift of
# popularity within tens of seconds, long enough that a rare model's rate is not noise.
DEMAND_TAU_S = 10.0
# Protects the models the plan keeps from the swap room's evictions.
KEPT = 1e12
# A model evicted this recently is "warm" here (its weights likely in the host-memory
# tier): the fleet's plan prefers this worker for it.
WARM_S = 60.0
# A swapped-in model's turn: after this (or two of its loads, if longer) its waiting
# requests no longer keep it in, so a saturated worker still swaps the others through.
TURN_S = 1.0


class Placed(NamedTuple):
    """The placement's one event to the loop: `model` became `state` (RESIDENT, LOADING,
    COLD); with `lora`, that adapter's load ended instead (RESIDENT, or COLD: failed);
    `why`: the load failed, and why (what is held for it is answered with it)."""

    model: str
    state: str
    lora: str | None = None
    why: str | None = None


class Placement:
    def __init__(self, runtime: Runtime, pool: Pool, models: list[str], pinned: set[str],
                 call_soon: Callable[..., Any], in_use: Callable[[], Mapping[str, int]],
                 on_placed: Callable[[Placed], None],
                 load_s: dict[str, float] | None = None) -> None:
        self.runtime = runtime
        self.pool = pool
        self.models = models  # all it may serve
        self.pinned = pinned
        self.call_soon = call_soon  # runs a callable on the event loop thread
        self.in_use = in_use  # keys with held, parked or running work: how many requests
        self.on_placed = on_placed  # the loop's: a model's state changed, a load ended
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-loader")
        self.failures: dict[str, tuple[float, str]] = {}  # model -> (when, why)
        self.started: dict[str, float] = {}  # model -> when its load began
        self.queued: list[tuple[str, str | None]] = []  # loads waiting, first come first
        self.current: tuple[str, str | None] | None = None  # the load running
        self.asked: set[str] = set()  # queued by an operator (shoal_load), not by requests
        self.estimates: dict[str, int] = {}  # key -> bytes the runtime estimated
        self._starting = False
        self.load_s = dict(load_s or {})  # expected seconds per load: profile, then measured
        self.meter = DemandMeter(models, DEMAND_TAU_S)  # what this worker is asked for
        self.fleet = False  # SHOAL_PLACEMENT=fleet: `follow` gives the plan
        self.keep: frozenset[str] = frozenset()  # what the fleet's plan has it keep
        self.demand: dict[str, Demand] = {}  # the fleet's, by model
        self.evicted_at: dict[str, float] = {}  # model -> when it was last evicted here
        self.loaded_at: dict[str, float] = {}  # model -> when its last load ended
        self.running: Callable[[], Collection[str]] = frozenset  # models with a batch running
        now = time.monotonic()
        for model, measured in runtime.resident.items():  # what the runtime started with
            pool.add(model, measured, now, pinned=model in pinned)
        self._gauges()

    # --- state ---------------------------------------------------------------------------

    def state(self, model: str) -> str:
        if self.pool.resident(model):
            return RESIDENT
        return LOADING if self.pool.loading(model) or (model, None) in self.queued else COLD

    def load_seconds(self, model: str) -> float:
        """How long a load of `model` takes (measured here last time, else the profile's)."""
        return self.load_s.get(model, DEFAULT_LOAD_S)

    def lora_resident(self, model: str, lora: str) -> bool:
        return self.pool.resident(lora_key(model, lora))

    def touch(self, key: str) -> None:
        """A request for `key` arrived (its model's demand counts it)."""
        now = time.monotonic()
        self.pool.touch(key, now)
        self.meter.arrived(key, now)

    def ran(self, model: str, seconds: float) -> None:
        """A batch of `model` kept the device busy for `seconds`."""
        self.meter.ran(model, seconds, time.monotonic())

    def follow(self, plan: Plan, me: str, demand: dict[str, Demand]) -> None:
        """The fleet's latest plan and demand: what to keep, what eviction costs."""
        self.fleet, self.keep, self.demand = True, plan.keep.get(me, frozenset()), demand

    def _value(self, key: str) -> float:
        model = key.partition(LORA_SEPARATOR)[0]
        return eviction_value(self.demand.get(model) or Demand()) + KEPT * (model in self.keep)

    def _eviction_rules(self, key: str) -> tuple[dict[str, float] | None, set[str]]:
        """How `pool.admit` orders and protects what it may evict for `key` (LRU, nothing
        protected, unless the fleet decides)."""
        if not self.fleet:
            return None, set()
        order = {k: self._value(k) for k in self.pool.slots}
        incoming = self._value(key)
        return order, {k for k, v in order.items() if v >= incoming and v >= KEPT}

    def snapshot(self) -> dict[str, Any]:
        """What `celery inspect shoal_models` and the pool-state messages report."""
        now = time.monotonic()
        models = []
        for model in self.models:
            slot = self.pool.slots.get(model)
            loras = sorted(k.rpartition(LORA_SEPARATOR)[2] for k in self.pool.adapters_of(model)
                           if self.pool.resident(k))
            models.append({"id": model, "state": self.state(model),
                           "pinned": model in self.pinned,
                           "bytes": slot.bytes if slot is not None and not slot.loading
                           else None, "loras": loras,
                           "estimate": slot.bytes if slot is not None
                           else self._estimate(model, None),
                           **self.meter.report(model, now),
                           "load_s": round(self.load_seconds(model), 4),
                           "warm": now - self.evicted_at.get(model, -WARM_S) < WARM_S})
        return {"budget_bytes": self.pool.budget, "used_bytes": self.pool.used(),
                "models": models}

    # --- loads (event loop thread) ---------------------------------------------------------

    def ensure(self, model: str, lora: str | None = None, asked: bool = False) -> str | None:
        """Have `model` (or its LoRA adapter `lora`, once the model is resident: until
        then, the model) loaded: None, or why it cannot be (it failed to load moments
        ago, or it could not fit even with every unpinned model evicted); the caller
        answers its requests then. Otherwise its load is queued and starts when the
        loader is free and it fits (`_start_next`). `asked`: by an operator, so it loads
        even with no request waiting."""
        if lora is not None and not self.pool.resident(model):
            lora = None  # the model first; the dispatcher asks again once it is resident
        key = model if lora is None else lora_key(model, lora)
        if self.pool.resident(key) or self.pool.loading(key) or (model, lora) in self.queued:
            return None
        now = time.monotonic()
        failure = self.failures.get(key)
        if failure is not None and now - failure[0] < FAILURE_MEMORY_S:
            return failure[1]
        estimate = self._estimate(model, lora)
        room = self.pool.budget - sum(s.bytes for s in self.pool.slots.values() if s.pinned)
        if estimate > room:
            why = (f"{key} does not fit this worker's device memory: it needs about "
                   f"{estimate / 2**20:.1f} MiB and the budget leaves {room / 2**20:.1f} MiB "
                   "beside the pinned models (SHOAL_DEVICE_MEMORY_BYTES, SHOAL_PIN)")
            metrics.LOADS.labels(model, "does_not_fit").inc()
            self.failures[key] = (now, why)
            return why
        self.queued.append((model, lora))
        if asked:
            self.asked.add(key)
        if lora is None:
            self.on_placed(Placed(model, LOADING))
        self._start_next()
        return None

    def _estimate(self, model: str, lora: str | None) -> int:
        """The runtime's estimate, read once (it stats the weight files, and a queued load
        is tried again after every batch), then what the model measured once loaded."""
        key = model if lora is None else lora_key(model, lora)
        estimate = self.estimates.get(key)
        if estimate is None:
            estimate = self.estimates[key] = self.runtime.estimate_bytes(model, lora)
        return estimate

    def kick(self) -> None:
        """Something was freed (a batch ended, requests were answered): a queued load
        that did not fit may fit now."""
        if self.queued and self.current is None:
            self._start_next()

    def _start_next(self) -> None:
        """Start the first queued load that fits now, evicting for it at this moment (not
        when it was queued: what is in use changes meanwhile). One load at a time: loads
        share the device's bandwidth, and the pool can only promise room for what runs."""
        if self.current is not None or self._starting:
            return  # (re-entered from a callback below: the outer call goes on)
        self._starting = True
        try:
            self._start_first_that_fits()
        finally:
            self._starting = False

    def _start_first_that_fits(self) -> None:
        now = time.monotonic()
        in_use = self.in_use()
        for gone in [(m, lo) for m, lo in self.queued
                     if (m if lo is None else lora_key(m, lo)) not in set(in_use) | self.asked]:
            self.queued.remove(gone)  # nobody waits for it any more
            if gone[1] is None:
                self.on_placed(Placed(gone[0], COLD))
        in_use = self.in_use()  # those callbacks may have taken new requests in
        # The load most requests wait for first (first come among equals): a popular
        # model must not wait behind the loads of rare ones. The fleet's: the models kept
        # first, then the swapped-in ones as they came (a rare one's wait stays bounded).
        self.queued.sort(key=(lambda q: q[0] not in self.keep) if self.fleet else (
            lambda q: -in_use.get(q[0] if q[1] is None else lora_key(q[0], q[1]), 0)))
        for i, (model, lora) in enumerate(self.queued):
            if lora is not None and not self.pool.resident(model):
                continue  # its model was evicted meanwhile; asked again once it is back
            key = model if lora is None else lora_key(model, lora)
            order, protect = self._eviction_rules(key)
            try:
                evicted = self.pool.admit(key, self._estimate(model, lora), now,
                                          self._holding(in_use, now),
                                          base=None if lora is None else model,
                                          order=order, protect=protect)
            except DoesNotFit:
                continue  # not now: what is in use or loading must end first
            del self.queued[i]
            self.asked.discard(key)
            self.current = (model, lora)
            self.started[key] = now
            reason = "lru" if order is None else "value"
            for gone in evicted:
                self.evicted_at[gone] = now
                metrics.EVICTIONS.labels(gone.partition(LORA_SEPARATOR)[0], reason).inc()
                log.info("evicting %s to make room for %s (%s)", gone, key, reason)
            log.info("loading %s", key)
            future = self.executor.submit(self._load, model, lora, evicted)
            future.add_done_callback(
                lambda f, m=model, lo=lora: self.call_soon(self._loaded, m, lo, f))
            self._gauges()
            # Evicted at the end of its turn with requests waiting: it queues again.
            again = [g for g in evicted if LORA_SEPARATOR not in g and in_use.get(g)]
            self.queued += [(g, None) for g in again]
            # Told last: a callback may come back here (a consumer restarting delivers).
            for gone in evicted:
                if LORA_SEPARATOR not in gone:
                    self.on_placed(Placed(gone, LOADING if gone in again else COLD))
            return

    def _holding(self, in_use: Mapping[str, int], now: float) -> Mapping[str, int]:
        """What keeps its model in: its requests, except a swapped-in model's waiting ones
        once its turn is over (fleet placement; a batch running always keeps it)."""
        if not self.fleet:
            return in_use
        running = self.running()
        over = {m for m, at in self.loaded_at.items()
                if m not in self.keep and m not in running and self.pool.resident(m)
                and now - at >= max(TURN_S, 2 * self.load_seconds(m))}
        return {k: n for k, n in in_use.items() if k not in over}

    def unload(self, model: str) -> str | None:
        """Drop a model now (operators' `shoal_unload`): None, or why not."""
        if model in self.pinned:
            return f"{model} is pinned (SHOAL_PIN)"
        if not self.pool.resident(model):
            return f"{model} is {self.state(model)}, not resident"
        if model in self.in_use():
            return f"{model} has requests held or running"
        self.pool.remove(model)  # with its LoRA adapters
        self.on_placed(Placed(model, COLD))
        self.executor.submit(self.runtime.unload, model)
        self._gauges()
        return None

    def _load(self, model: str, lora: str | None, evicted: list[str]) -> tuple[int, float]:
        """On the loader thread: the evictions, then the load; (bytes, seconds)."""
        for gone in evicted:
            base, _, gone_lora = gone.partition(LORA_SEPARATOR)
            if gone_lora and base in evicted:
                continue  # goes with its model
            self.runtime.unload(base, gone_lora or None)
        # Measured from here: a load's own time. Its wait in the queue shows in the
        # requests' X-Queue-Time-Ms and shoal_model_load_wait_seconds.
        started = time.perf_counter()
        measured = self.runtime.load(model, lora)
        return measured, time.perf_counter() - started

    def _loaded(self, model: str, lora: str | None, future: Future) -> None:
        now = time.monotonic()
        key = model if lora is None else lora_key(model, lora)
        self.started.pop(key, None)
        self.current = None
        try:
            self._finish_load(model, lora, key, future, now)
        finally:
            self._start_next()

    def _finish_load(self, model: str, lora: str | None, key: str, future: Future,
                     now: float) -> None:
        try:
            measured, seconds = future.result()
        except Exception as exc:
            why = f"{key} could not be loaded: {exc}"
            log.error("%s", why)
            self.pool.failed(key)
            self.failures[key] = (now, why)
            metrics.LOADS.labels(model, "failed").inc()
            self.on_placed(Placed(model, COLD, lora, why))
            self._gauges()
            return
        if key not in self.pool.slots:  # its model was unloaded meanwhile
            self.executor.submit(self.runtime.unload, model, lora)
            return
        self.pool.loaded(key, measured, now)
        self.estimates[key] = measured  # the next load of it, after an eviction, needs as much
        self.failures.pop(key, None)
        metrics.LOADS.labels(model, "ok").inc()
        log.info("loaded %s (%.1f MiB) in %.2fs; %.1f of %.1f MiB in use", key,
                 measured / 2**20, seconds, self.pool.used() / 2**20, self.pool.budget / 2**20)
        if lora is None:
            metrics.LOAD_SECONDS.labels(model).observe(seconds)
            self.load_s[model] = seconds
            self.loaded_at[model] = now
        self.on_placed(Placed(model, RESIDENT, lora))
        self._gauges()

    def _gauges(self) -> None:
        resident = [s for s in self.pool.slots.values() if not s.loading]
        metrics.RESIDENT_MODELS.set(len(resident))
        metrics.RESIDENT_BYTES.set(sum(s.bytes for s in resident))
        metrics.BUDGET_BYTES.set(self.pool.budget)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
