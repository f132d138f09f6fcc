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

from batching.feeder import Load
from runtimes.base import Capabilities, OnDeltas, Outcome, Request, Runtime, SentAhead
from tasks.engines import DEFAULT


class RuntimeRouter:
    """Every call about a model goes to the runtime of its engine (module doc)."""

    def __init__(self, runtimes: Mapping[str, Runtime],
                 model_runtime: Mapping[str, str]) -> None:
        """`runtimes` by engine name; `model_runtime`: each model's engine (a model it does
        not name goes to the default engine's)."""
        self.runtimes = dict(runtimes)
        self.model_runtime = dict(model_runtime)
        each = [r.capabilities for r in self.runtimes.values()]
        # The batching runtimes' threads and replicas (continuous ones take one of each);
        # send-ahead where a runtime has it (`send_ahead` of another's model gives None).
        self.capabilities = Capabilities(
            pipeline_depth=max((c.pipeline_depth for c in each), default=1),
            parallel=max((c.parallel for c in each), default=1),
            send_ahead=any(c.send_ahead for c in each))

    def _of(self, model_id: str) -> Runtime:
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
        return self._of(model_id).ready_in(model_id)

    def watch_availability(self, callback: Callable[[], None]) -> None:
        for runtime in self.runtimes.values():
            runtime.watch_availability(callback)

    def continuous(self, model_id: str) -> bool:
        return self._of(model_id).continuous(model_id)

    def send_ahead(self, model_id: str, requests: list[Request]) -> SentAhead | None:
        return self._of(model_id).send_ahead(model_id, requests)

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None, ahead: SentAhead | None = None
                  ) -> list[Outcome]:
        return self._of(model_id).run_batch(model_id, requests, on_deltas, ahead)

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
