"""One worker, several engines: each model is served by the runtime of its engine.

`RuntimeRouter` is the `runtimes.base.Runtime` the worker sees when its models run on
several engines (`tasks.engines`: PyTorch and ONNX Runtime in child processes, SGLang
servers): every call about a model goes to that model's runtime, and what the worker
reads about the device (resident models, counters) is the sum of all. They share one
memory budget: the placement counts each model's bytes wherever it lives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from batching.feeder import Load
from runtimes.base import OnDeltas, Outcome, Request
from tasks.engines import DEFAULT


class RuntimeRouter:
    def __init__(self, runtimes: Mapping[str, Any], model_runtime: Mapping[str, str]) -> None:
        """`runtimes` by engine name; `model_runtime`: each model's engine (a model it does
        not name goes to the default engine's)."""
        self.runtimes = dict(runtimes)
        self.model_runtime = dict(model_runtime)

    def _of(self, model_id: str) -> Any:
        return self.runtimes[self.model_runtime.get(model_id, DEFAULT)]

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.runtimes.values())

    @property
    def poison_isolated(self) -> int:
        return sum(r.poison_isolated for r in self.runtimes.values())

    @property
    def spare_promotions(self) -> int:
        return sum(r.spare_promotions for r in self.runtimes.values())

    @property
    def start_failures(self) -> int:
        return sum(r.start_failures for r in self.runtimes.values())

    @property
    def pipeline_depth(self) -> int:
        """Batches in flight at once: the batching runtimes' (continuous ones get none)."""
        return max((r.pipeline_depth for r in self.runtimes.values()), default=1)

    @property
    def parallel(self) -> int:
        """Batches run side by side: the replicas of the batching runtimes."""
        return max((r.parallel for r in self.runtimes.values()), default=1)

    @property
    def pid(self) -> int | None:
        return next((r.pid for r in self.runtimes.values() if r.pid is not None), None)

    @property
    def resident(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for runtime in self.runtimes.values():
            merged.update(runtime.resident)
        return merged

    @property
    def device_bytes(self) -> int | None:
        return next((r.device_bytes for r in self.runtimes.values()
                     if r.device_bytes is not None), None)

    def ready_in(self, model_id: str) -> float | None:
        """The model's runtime's `ready_in`, where it has one (a runtime process)."""
        ready_in = getattr(self._of(model_id), "ready_in", None)
        return ready_in(model_id) if ready_in is not None else None

    def watch_availability(self, callback: Callable[[], None]) -> None:
        for runtime in self.runtimes.values():
            watch = getattr(runtime, "watch_availability", None)
            if watch is not None:
                watch(callback)

    def continuous(self, model_id: str) -> bool:
        return self._of(model_id).continuous(model_id)

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None) -> list[Outcome]:
        return self._of(model_id).run_batch(model_id, requests, on_deltas)

    def submit(self, model_id: str, request: Request,
               on_deltas: OnDeltas | None = None) -> Future[Outcome]:
        return self._of(model_id).submit(model_id, request, on_deltas)

    def load_of(self, model_id: str) -> Load:
        return self._of(model_id).load_of(model_id)

    def cancel(self, request_ids: list[str]) -> None:
        for runtime in self.runtimes.values():
            runtime.cancel(request_ids)

    def estimate_bytes(self, model_id: str, lora: str | None = None) -> int:
        return self._of(model_id).estimate_bytes(model_id, lora)

    def load(self, model_id: str, lora: str | None = None) -> int:
        return self._of(model_id).load(model_id, lora)

    def unload(self, model_id: str, lora: str | None = None) -> None:
        self._of(model_id).unload(model_id, lora)

    def close(self) -> None:
        for runtime in self.runtimes.values():
            runtime.close()
