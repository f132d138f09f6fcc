"""The model host: loads the served models and runs batches of requests.

One host per device and engine: an engine of the registry that computes in shoal's
runtime process (`tasks.engines`, kind "process": PyTorch, ONNX Runtime); the engine says
which adapter class serves an entry and how the device's memory and busy time are read,
so this module imports none. It runs
either inside the worker on a dedicated thread or, behind a socket, in its own process
(`runtimes.child_side.server`); it keeps no reference to the broker, so both compute the same
thing.

The host-memory tier (issue 51): a model unloaded while the host's budget allows is
kept, its weights in host memory (`host_tier`, the engine's `offload`), so that loading
it again is a copy back to the device, not a read and build from disk.

An inference exception propagates out of `run_batch`: the caller decides
which request is to blame (`runtimes.worker_side.bisection` bisects the batch). Only
problems found by checking a request before inference are per-request
outcomes here.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from batching.pool import keys_of, lora_key
from runtimes.base import Delta, OnDeltas, Outcome, Request, failed, prepare_each
from runtimes.child_side.adapter import Adapter, Stream
from runtimes.child_side.before_device import DeviceFloor, unwanted
from runtimes.child_side.host_tier import HostTier
from tasks import engines
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode
from tasks.served import stamp_batch
from tasks.sources import resolve_source

log = logging.getLogger(__name__)

# Cancelled ids kept at most: one cancelled after its batch ended is never forgotten else.
MAX_CANCELLED = 65_536


class Engine(Protocol):
    """What the host needs of the library that computes (see the module doc): the class a
    registry entry's `start` names, built as `Class(device, threads)`."""

    name: str
    clock: Any  # take_span() after a batch's forward: a span whose seconds() it was busy
    # Family -> its adapter class, "module:Class" (imported when an entry of it loads; a
    # spare imports the catalog's ahead): the registry entry's `families` are its keys.
    adapters: Mapping[str, str]

    def adapter_class(self, entry: ModelEntry) -> type[Adapter]: ...
    def precision(self, entry: ModelEntry, override: str | None) -> str: ...
    def allocated(self) -> int: ...
    def measure(self, adapter: Adapter, allocated_before: int) -> int: ...
    def release(self) -> None: ...

    def offload(self, adapter: Adapter, budget: int) -> int | None:
        """Make an unloaded model's adapter fit to be kept in host memory (on a GPU its
        weights move to host memory): the host bytes it then takes; None, and nothing
        moved, when it cannot be kept or takes more than `budget` bytes."""
        ...

    def restore(self, adapter: Adapter) -> None:
        """Put an adapter `offload` made fit back on the device, as it was."""
        ...
    def total_bytes(self) -> int: ...
    def stamp(self) -> dict[str, Any] | None: ...

    def warm(self) -> None:
        """A spare's warm-up once imported: the library's first-call costs that touch no
        device (nothing, for an engine that has none)."""
        ...


def make_engine(name: str, device: str, threads: int = 0) -> Engine:
    """The engine of that name (its library imported now, the others never)."""
    registered = engines.engine(name)
    if registered.kind != "process":
        raise ValueError(f"engine {name!r} does not compute in shoal's runtime process; "
                         f"those that do: {engines.names('process')}")
    return engines.resolve(registered.start)(device, threads)


@dataclass(slots=True)
class BatchWork:
    """One batch on its way through the host's stages (`begin`, `forward`, `finish`)."""

    model_id: str
    requests: list[Request]
    adapter: Adapter | None
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # refused requests, then all
    runnable: list[tuple[Request, Any]] = field(default_factory=list)
    started: float = 0.0  # perf_counter, when its checks were done
    planned: Any = None
    stream: Stream | None = None
    output: Any = None
    device: Any = None  # its forward passes' device time (the engine clock's span)


class ModelHost:
    """Holds loaded models by id and runs batches on them.

    Loads and unloads may come from another thread than batches (the runtime process
    loads beside serving); the caller never unloads a model while a batch of it runs.

    `host_bytes` is the host-memory tier's budget (0: off): an unloaded model is kept in
    `tier` (a `HostTier` of adapters; its `hits` count the loads it served) while it
    fits, the least recently unloaded dropped first; its LoRA adapters are not kept.
    """

    def __init__(self, device: str = "cpu", threads: int = 0, chunk_tokens: int = 16_384,
                 precision: str | None = None, engine: str = engines.DEFAULT,
                 host_bytes: int = 0) -> None:
        self.device = device
        self.chunk_tokens = chunk_tokens
        # For every model; None: each entry's (runtimes.model_files.precision).
        self.precision = precision
        self.engine = make_engine(engine, device, threads)
        self.clock = self.engine.clock
        self._models: dict[str, Adapter] = {}
        self.footprints: dict[str, int] = {}  # measured device bytes, by model id
        self._loading = threading.Lock()  # one load at a time: their memory adds up
        self.tier: HostTier[Adapter] = HostTier(host_bytes)  # unloaded models kept
        # Requests whose callers left (from any thread), oldest first: an id is forgotten
        # when its batch ends, or, cancelled after that, once MAX_CANCELLED newer ones came.
        self._cancelled: dict[str, None] = {}
        self._cancel_lock = threading.Lock()
        # Batches whose device work was skipped: all their requests cancelled or late.
        self.skipped = 0
        self.device_floor = DeviceFloor()  # what a request's deadline must leave the device

    def load(self, entries: Iterable[ModelEntry]) -> None:
        for entry in entries:
            self.load_one(entry)

    def load_one(self, entry: ModelEntry) -> int:
        """Load a model (a no-op if loaded): the device bytes it takes, measured."""
        with self._loading:
            if entry.id in self._models:
                return self.footprints[entry.id]
            started = time.perf_counter()
            kept = self.tier.take(entry.id)
            if kept is not None and kept.entry == entry:
                return self._restore(entry, kept, started)
            del kept  # none, or built from another entry of that id: built again
            allocated = self.engine.allocated()
            precision = self.engine.precision(entry, self.precision)
            adapter = self.engine.adapter_class(entry)(
                entry, resolve_source(entry.source), device=self.device,
                chunk_tokens=self.chunk_tokens, precision=precision,
            )
            measured = self.engine.measure(adapter, allocated)
            self._models[entry.id] = adapter
            self.footprints[entry.id] = measured
            log.info("loaded %s (%s, %s, %.1f MiB) in %.1fs", entry.id, entry.adapter,
                     precision, measured / 2**20, time.perf_counter() - started)
            return measured

    def _restore(self, entry: ModelEntry, adapter: Adapter, started: float) -> int:
        """A model kept in the host tier back on the device (under `_loading`)."""
        allocated = self.engine.allocated()
        self.engine.restore(adapter)
        measured = self.engine.measure(adapter, allocated)
        self._models[entry.id] = adapter
        self.footprints[entry.id] = measured
        log.info("loaded %s from host memory (%.1f MiB) in %.3fs", entry.id, measured / 2**20,
                 time.perf_counter() - started)
        return measured

    def unload(self, model_id: str) -> None:
        """Free a model and its LoRA adapters from the device; the model is kept in the
        host tier if it fits there (its LoRA adapters are freed)."""
        adapter = self._models.pop(model_id, None)
        for key in keys_of(model_id, self.footprints):
            del self.footprints[key]
        if adapter is None:
            return
        kept = self._keep(model_id, adapter)
        del adapter
        if kept is None:
            gc.collect()  # adapters hold reference cycles (modules, hooks)
        self.engine.release()
        log.info("unloaded %s%s", model_id, f" (kept in host memory: {kept / 2**20:.1f} MiB)"
                 if kept is not None else "")

    def _keep(self, model_id: str, adapter: Adapter) -> int | None:
        """Keep an unloaded model in the host tier if it fits: the host bytes it takes
        there (the least recently kept ones dropped to make room), or None."""
        if not self.tier.on:
            return None
        loras = sorted(adapter.loaded_loras)
        for lora in loras:
            adapter.unload_lora(lora)
        if loras:
            gc.collect()  # their tensors, in peft's reference cycles
        nbytes = self.engine.offload(adapter, self.tier.budget)
        if nbytes is None:
            self.tier.refused += 1
            return None
        dropped = self.tier.put(model_id, adapter, nbytes)
        for key, value in dropped:
            if value is not adapter:
                log.info("dropped %s from host memory (room for %s)", key, model_id)
        if any(value is adapter for _, value in dropped):
            return None
        if dropped:
            del dropped
            gc.collect()  # what was dropped frees its host memory now
        return nbytes

    def load_lora(self, model_id: str, lora: str) -> int:
        """Load a LoRA adapter of a loaded model (a no-op if loaded): the bytes it takes."""
        with self._loading:
            adapter = self._models.get(model_id)
            if adapter is None:
                raise ValueError(f"{model_id} is not loaded")
            if not adapter.supports_lora:
                raise ValueError(f"{model_id} ({adapter.entry.adapter}) serves no LoRA adapters")
            source = adapter.entry.loras.get(lora)
            if source is None:
                raise ValueError(f"{model_id} has no LoRA adapter {lora!r} in the catalog")
            key = lora_key(model_id, lora)
            if lora in adapter.loaded_loras:
                return self.footprints[key]
            started = time.perf_counter()
            measured = adapter.load_lora(lora, resolve_source(source))
            self.footprints[key] = measured
            log.info("loaded LoRA %s of %s (%.1f MiB) in %.2fs", lora, model_id,
                     measured / 2**20, time.perf_counter() - started)
            return measured

    def unload_lora(self, model_id: str, lora: str) -> None:
        adapter = self._models.get(model_id)
        self.footprints.pop(lora_key(model_id, lora), None)
        if adapter is None or lora not in adapter.loaded_loras:
            return
        adapter.unload_lora(lora)
        gc.collect()
        self.engine.release()
        log.info("unloaded LoRA %s of %s", lora, model_id)

    def device_total_bytes(self) -> int:
        """The memory of the device models load into (RAM on CPU)."""
        return self.engine.total_bytes()

    def adapter(self, model_id: str) -> Adapter | None:
        return self._models.get(model_id)

    def cancel(self, request_ids: list[str]) -> None:
        """These requests' callers left (from any thread): a generation stops at its next
        step, and a batch whose runnable requests are all cancelled before its device
        work skips it (`forward`)."""
        with self._cancel_lock:
            self._cancelled.update(dict.fromkeys(request_ids))
            while len(self._cancelled) > MAX_CANCELLED:
                del self._cancelled[next(iter(self._cancelled))]

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None) -> list[Outcome]:
        """One batch, its stages in a row (a streamed one through the adapter's stream)."""
        try:
            work = self.begin(model_id, requests, on_deltas)
            self.forward(work)
            return self.finish(work)
        finally:
            self.forget_cancelled(requests)

    def begin(self, model_id: str, requests: list[Request],
              on_deltas: OnDeltas | None = None) -> BatchWork:
        """A batch's host work before the device: each request checked (a refused one
        fails alone), then the adapter's `plan`. Raises what the plan raises."""
        work = BatchWork(model_id, requests, self._models.get(model_id))
        if work.adapter is None:
            work.outcomes = {r.id: failed(r.id, ErrorCode.MODEL_NOT_FOUND,
                                          f"this worker does not serve {model_id}")
                             for r in requests}
            return work
        adapter = work.adapter
        work.outcomes, work.runnable = prepare_each(model_id, adapter.operation, requests,
                                                    lambda r: adapter.prepare(r.kwargs))
        if not work.runnable:
            return work
        work.started = time.perf_counter()
        prepared = [p for _, p in work.runnable]
        if adapter.streams and on_deltas is not None:
            # A stream talks to its caller step by step: it runs whole, in `forward`.
            work.stream = self._stream([r for r, _ in work.runnable], on_deltas)
            work.planned = prepared
        else:
            work.planned = adapter.plan(prepared)
        return work

    def forward(self, work: BatchWork) -> None:
        """A batch's device work (one batch at a time: the device clock's span after it
        is this batch's). Raises what the model raises."""
        if work.adapter is None or not work.runnable or self._drop_before_device(work):
            return
        self.clock.take_span()  # what ran before this batch (a load, a probe) is not its
        try:
            if work.stream is not None:
                work.output = work.adapter.run(work.planned, work.stream)
            else:
                work.output = work.adapter.forward(work.planned)
        finally:
            work.device = self.clock.take_span()

    def finish(self, work: BatchWork) -> list[Outcome]:
        """A batch's outcomes, in request order, once its outputs are on the host."""
        if work.adapter is not None and work.runnable:
            results = work.output if work.stream is not None else \
                work.adapter.finish(work.planned, work.output)
            device_s = work.device.seconds() if work.device is not None else None
            stamp_batch(results, work.model_id, (r.kwargs for r, _ in work.runnable),
                        work.started, self.engine.stamp(), device_s=device_s)
            if device_s is not None:
                self.device_floor.observe(work.model_id, device_s)
            for (request, _), result in zip(work.runnable, results, strict=True):
                work.outcomes[request.id] = Outcome(request.id, result=result)
        return [work.outcomes[r.id] for r in work.requests]

    def _drop_before_device(self, work: BatchWork) -> bool:
        """Before a batch's device work: its requests nobody will read (revoked, or past
        their deadline by the time the device could finish them:
        `runtimes.child_side.before_device`) are answered so and taken out, and the rest is
        planned again without them; True when none is left (the batch never reaches the
        device). A stream stops its cancelled rows itself, step by step."""
        if work.stream is not None:
            return False
        done_by_ms = (time.time() + self.device_floor.seconds(work.model_id)) * 1000
        with self._cancel_lock:
            dropped = unwanted(work.runnable, self._cancelled, done_by_ms)
        if not dropped:
            return False
        work.outcomes.update(dropped)
        work.runnable = [(r, p) for r, p in work.runnable if r.id not in dropped]
        if work.runnable:
            assert work.adapter is not None
            work.planned = work.adapter.plan([p for _, p in work.runnable])
            return False
        log.info("skipped a batch of %d requests for %s: all revoked or past their deadline "
                 "before it reached the device", len(dropped), work.model_id)
        self.skipped += 1
        return True

    def forget_cancelled(self, requests: list[Request]) -> None:
        with self._cancel_lock:
            for request in requests:
                self._cancelled.pop(request.id, None)

    def _stream(self, requests: list[Request], on_deltas: OnDeltas) -> Stream:
        """The adapter's `Stream` for a batch: deltas of its streamed requests go to
        `on_deltas`, and each step learns which requests were cancelled meanwhile."""
        ids = [r.id for r in requests]

        def send(deltas: list[tuple[int, int, str, int]]) -> set[int]:
            if deltas:
                on_deltas([Delta(ids[n], index, text, tokens)
                           for n, index, text, tokens in deltas])
            with self._cancel_lock:
                if not self._cancelled:
                    return set()
                return {n for n, id_ in enumerate(ids) if id_ in self._cancelled}

        return Stream(frozenset(n for n, r in enumerate(requests) if r.stream), send)

    def close(self) -> None:
        self._models.clear()
        self.footprints.clear()
        self.tier.clear()
