"""Which models this worker holds: loads on first request, LRU evictions, pinned models.

The bookkeeping is `runtimes.pool.Pool`'s; this class drives it from the worker's event
loop thread and runs the loads and unloads on a thread of its own, beside the batches
of the models already loaded (the runtime takes them on a connection of their own), so
the event loop (and with it the broker heartbeats) never waits for a load.

Life of a model on a worker: cold -> loading -> resident -> (evicted) cold. A request
held for a model that is not resident starts its load at once; when it ends, `on_state`
tells the dispatcher (the lane may run, the consumer's priority rises) or `on_failed`
has every request held for it answered MODEL_UNAVAILABLE with the reason. A failure is
remembered for `FAILURE_MEMORY_S`, and the requests that arrive meanwhile are answered
at once instead of each trying the load again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from app import metrics
from runtimes.base import Runtime
from runtimes.pool import DoesNotFit, Pool
from tasks.pool_state import COLD, LOADING, RESIDENT

log = logging.getLogger(__name__)

FAILURE_MEMORY_S = 10.0
DEFAULT_LOAD_S = 1.0


class Placement:
    def __init__(self, runtime: Runtime, pool: Pool, models: list[str], pinned: set[str],
                 call_soon: Callable[..., Any], in_use: Callable[[], set[str]],
                 on_state: Callable[[str, str], None],
                 on_failed: Callable[[str, str], None],
                 load_s: dict[str, float] | None = None) -> None:
        self.runtime = runtime
        self.pool = pool
        self.models = models  # all it may serve
        self.pinned = pinned
        self.call_soon = call_soon  # runs a callable on the event loop thread
        self.in_use = in_use  # models with held or running work
        self.on_state = on_state  # (model, RESIDENT | LOADING | COLD)
        self.on_failed = on_failed  # (model, why): answer what is held for it
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-loader")
        self.failures: dict[str, tuple[float, str]] = {}  # model -> (when, why)
        self.started: dict[str, float] = {}  # model -> when its load began
        self.load_s = dict(load_s or {})  # expected seconds per load: profile, then measured
        now = time.monotonic()
        for model, measured in runtime.resident.items():  # what the runtime started with
            pool.add(model, measured, now, pinned=model in pinned)
        if pool.used() > pool.budget:
            log.warning("the pinned models take %.1f MiB, over the %.1f MiB budget: nothing "
                        "else can load", pool.used() / 2**20, pool.budget / 2**20)
        self._gauges()

    # --- state ---------------------------------------------------------------------------

    def state(self, model: str) -> str:
        if self.pool.resident(model):
            return RESIDENT
        return LOADING if self.pool.loading(model) else COLD

    def load_seconds(self, model: str) -> float:
        """How long a load of `model` takes (measured here last time, else the profile's)."""
        return self.load_s.get(model, DEFAULT_LOAD_S)

    def touch(self, model: str) -> None:
        self.pool.touch(model, time.monotonic())

    def snapshot(self) -> dict[str, Any]:
        """What `celery inspect shoal_models` and the pool-state messages report."""
        models = []
        for model in self.models:
            slot = self.pool.slots.get(model)
            models.append({"id": model, "state": self.state(model),
                           "pinned": model in self.pinned,
                           "bytes": slot.bytes if slot is not None and not slot.loading
                           else None, "loras": []})
        return {"budget_bytes": self.pool.budget, "used_bytes": self.pool.used(),
                "models": models}

    # --- loads (event loop thread) ---------------------------------------------------------

    def ensure(self, model: str) -> str | None:
        """Start loading `model` unless it is resident or loading: None, or why it cannot
        load (a recent failure, or it does not fit); the caller answers its requests."""
        if self.pool.resident(model) or self.pool.loading(model):
            return None
        failure = self.failures.get(model)
        if failure is not None and time.monotonic() - failure[0] < FAILURE_MEMORY_S:
            return failure[1]
        now = time.monotonic()
        try:
            evicted = self.pool.admit(model, self.runtime.estimate_bytes(model), now,
                                      self.in_use())
        except DoesNotFit as exc:
            why = f"{model} does not fit this worker's device memory: {exc}"
            metrics.LOADS.labels(model, "does_not_fit").inc()
            self.failures[model] = (now, why)
            return why
        for gone in evicted:
            metrics.EVICTIONS.labels(gone).inc()
            log.info("evicting %s to make room for %s", gone, model)
            self.on_state(gone, COLD)
        self._gauges()
        self.started[model] = now
        log.info("loading %s", model)
        self.on_state(model, LOADING)
        future = self.executor.submit(self._load, model, evicted)
        future.add_done_callback(lambda f: self.call_soon(self._loaded, model, f))
        return None

    def unload(self, model: str) -> str | None:
        """Drop a model now (operators' `shoal_unload`): None, or why not."""
        if model in self.pinned:
            return f"{model} is pinned (SHOAL_PIN)"
        if not self.pool.resident(model):
            return f"{model} is {self.state(model)}, not resident"
        if model in self.in_use():
            return f"{model} has requests held or running"
        self.pool.remove(model)
        self.on_state(model, COLD)
        self.executor.submit(self.runtime.unload, model)
        self._gauges()
        return None

    def _load(self, model: str, evicted: list[str]) -> tuple[int, float]:
        """On the loader thread: the evictions, then the load; (bytes, seconds)."""
        for gone in evicted:
            self.runtime.unload(gone)
        started = time.perf_counter()
        measured = self.runtime.load(model)
        return measured, time.perf_counter() - started

    def _loaded(self, model: str, future: Future) -> None:
        now = time.monotonic()
        self.started.pop(model, None)
        try:
            measured, seconds = future.result()
        except Exception as exc:
            why = f"{model} could not be loaded: {exc}"
            log.error("%s", why)
            self.pool.failed(model)
            self.failures[model] = (now, why)
            metrics.LOADS.labels(model, "failed").inc()
            self.on_state(model, COLD)
            self.on_failed(model, why)
            self._gauges()
            return
        self.pool.loaded(model, measured, now)
        self.failures.pop(model, None)
        metrics.LOADS.labels(model, "ok").inc()
        metrics.LOAD_SECONDS.labels(model).observe(seconds)
        self.load_s[model] = seconds
        log.info("loaded %s (%.1f MiB) in %.2fs; %.1f of %.1f MiB in use", model,
                 measured / 2**20, seconds, self.pool.used() / 2**20, self.pool.budget / 2**20)
        self.on_state(model, RESIDENT)
        self._gauges()

    def _gauges(self) -> None:
        resident = [s for s in self.pool.slots.values() if not s.loading]
        metrics.RESIDENT_MODELS.set(len(resident))
        metrics.RESIDENT_BYTES.set(sum(s.bytes for s in resident))
        metrics.BUDGET_BYTES.set(self.pool.budget)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
