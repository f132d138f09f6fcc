"""The model host: loads the served models and runs batches of requests.

One host per device. It runs either inside the worker on a dedicated thread
or, behind a socket, in its own process (`runtimes.server`); it keeps no
reference to the broker, so both compute the same thing.

An inference exception propagates out of `run_batch`: the caller decides
which request is to blame (`runtimes.process` bisects the batch). Only
problems found by checking a request before inference are per-request
outcomes here.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Iterable

import torch

from app.catalog import ModelEntry
from runtimes.base import Outcome, Request, failed, prepare_each
from runtimes.pytorch.adapter import Adapter
from runtimes.sources import resolve_source
from tasks.errors import ErrorCode
from tasks.served import stamp_batch

log = logging.getLogger(__name__)


def adapter_class(entry: ModelEntry) -> type[Adapter]:
    """The class that implements the entry's adapter (imported only when needed)."""
    module, _, name = entry.contract.implementation.partition(":")
    return getattr(importlib.import_module(module), name)


class ModelHost:
    """Holds loaded models by id and runs batches on them."""

    def __init__(self, device: str = "cpu", threads: int = 0, chunk_tokens: int = 16_384) -> None:
        self.device = device
        self.chunk_tokens = chunk_tokens
        if threads > 0:
            torch.set_num_threads(threads)
        self._models: dict[str, Adapter] = {}

    def load(self, entries: Iterable[ModelEntry]) -> None:
        for entry in entries:
            started = time.perf_counter()
            self._models[entry.id] = adapter_class(entry)(
                entry, resolve_source(entry.source), device=self.device,
                chunk_tokens=self.chunk_tokens,
            )
            log.info("loaded %s (%s) in %.1fs", entry.id, entry.adapter,
                     time.perf_counter() - started)

    def adapter(self, model_id: str) -> Adapter | None:
        return self._models.get(model_id)

    def run_batch(self, model_id: str, requests: list[Request]) -> list[Outcome]:
        adapter = self._models.get(model_id)
        if adapter is None:
            return [failed(r.id, ErrorCode.MODEL_NOT_FOUND,
                           f"this worker does not serve {model_id}") for r in requests]
        outcomes, runnable = prepare_each(model_id, adapter.operation, requests,
                                          lambda r: adapter.prepare(r.kwargs))
        if runnable:
            started = time.perf_counter()
            results = adapter.run([prepared for _, prepared in runnable])
            stamp_batch(results, model_id, (r.kwargs for r, _ in runnable), started)
            for (request, _), result in zip(runnable, results, strict=True):
                outcomes[request.id] = Outcome(request.id, result=result)
        return [outcomes[r.id] for r in requests]

    def close(self) -> None:
        self._models.clear()
