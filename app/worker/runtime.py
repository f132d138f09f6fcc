"""The model runtime a worker starts: its engines' (`tasks.engines`), one per engine that
serves one of its models, behind a router (by model) when there are several; or a double
(simulated) that serves them all. Their own process(es), started with the pinned models
loaded."""

from __future__ import annotations

import logging
from typing import cast

from runtimes.base import Runtime, StartRuntime
from runtimes.model_files.footprint import host_tier_bytes
from runtimes.model_files.precision import profile_on
from runtimes.worker_side.process import ProcessRuntime
from runtimes.worker_side.replicas import ReplicaSet, default_replicas
from tasks import engines
from tasks.catalog import BatchProfile, ModelEntry
from tasks.settings import Settings

log = logging.getLogger(__name__)


def start_runtime(entries: list[ModelEntry], pinned: set[str], settings: Settings,
                  chunk_tokens: int) -> Runtime:
    """The runtime of SHOAL_RUNTIME, the pinned models loaded (`chunk_tokens`: the most
    tokens a batch of any served model holds). The runtime processes of several engines
    share the worker's memory budget through the placement, which counts each model's
    bytes wherever it lives."""
    worker_engine = engines.engine(settings.runtime)
    if worker_engine.kind == "double":
        # Imported by name: a real worker never loads it, a simulated one never loads torch.
        return _starter(worker_engine)(entries, sorted(pinned), settings)
    on = runtime_of_models(entries, worker_runtime(settings), settings.device)
    runtimes: dict[str, Runtime] = {}
    for name, registered in engines.ENGINES.items():
        if name not in on.values():
            continue
        served = [e for e in entries if on[e.id] == name]
        models = [e.id for e in served if e.id in pinned]
        if registered.kind == "process":
            # A worker-wide format applies to the engine that has it (int8: ONNX only).
            precision = settings.precision if settings.precision in registered.precisions \
                else None
            runtimes[name] = _process_runtimes(settings, name, precision, chunk_tokens, models)
        else:
            runtimes[name] = _starter(registered)(served, models, settings)
    if len(runtimes) == 1:
        return next(iter(runtimes.values()))
    from runtimes.worker_side.router import RuntimeRouter

    return RuntimeRouter(runtimes, on)


def _starter(registered: engines.EngineEntry) -> StartRuntime:
    return cast(StartRuntime, engines.resolve(registered.start))


def _process_runtimes(settings: Settings, engine: str, precision: str | None,
                      chunk_tokens: int, models: list[str]) -> ProcessRuntime | ReplicaSet:
    """The runtime process of `engine`, or SHOAL_RUNTIME_REPLICAS of them on the device
    (they share the host-memory tier's budget, SHOAL_HOST_MEMORY_BYTES, in equal parts)."""
    replicas = settings.runtime_replicas
    count = default_replicas(settings.device) if replicas == "auto" else replicas
    host_bytes = host_tier_bytes(settings.host_memory_bytes) // count

    def start(index: int, env: dict[str, str] | None = None) -> ProcessRuntime:
        # answer_while_restarting: when a dead runtime's replacement dies too while it
        # loads, the next one is still importing (~7 s on 2 cores); the worker answers
        # 503 MODEL_UNAVAILABLE meanwhile instead of leaving its queue unanswered.
        return ProcessRuntime(
            catalog_dir=settings.catalog_dir, models=models, device=settings.device,
            threads=settings.torch_threads, chunk_tokens=chunk_tokens,
            start_timeout=settings.runtime_start_timeout_s,
            batch_timeout=settings.runtime_batch_timeout_s,
            spare=settings.runtime_spare, precision=precision,
            pipeline_depth=settings.runtime_pipeline_depth, engine=engine, env=env,
            answer_while_restarting=True, host_bytes=host_bytes)

    if count == 1:
        return start(0)
    log.info("%s: %d runtime processes on %s (SHOAL_RUNTIME_REPLICAS=%s)", engine, count,
             settings.device, replicas)
    return ReplicaSet(start, count)


def worker_runtime(settings: Settings) -> str | None:
    """SHOAL_RUNTIME where it is set (to pytorch too: it then overrides the profiles'
    choices), else None."""
    return settings.runtime if "runtime" in settings.model_fields_set else None


def runtime_of_models(entries: list[ModelEntry], worker_runtime: str | None,
                      device: str = "cpu") -> dict[str, str]:
    """Which engine serves each model, first that applies: the entry's `runtime:` when it
    is not the default; the worker's (SHOAL_RUNTIME; None where it is not set) if that
    engine takes the entry (`EngineEntry.takes`: SGLang every causal LM and
    last-token-pooled (decoder) embedder, ONNX Runtime every entry of its families
    without LoRA adapters); the entry's own `runtime: pytorch`; the engine its profile
    for `device` names (measured fastest with vectors within the parity bound by
    `shoal onboard` / `shoal tune`) if that engine serves the entry (no LoRAs on ONNX);
    else the default (PyTorch)."""
    worker = engines.engine(worker_runtime) if worker_runtime is not None else None

    def runtime(e: ModelEntry) -> str:
        if e.runtime != engines.DEFAULT:
            return e.runtime
        if worker is not None and worker.takes_over(e):
            return worker.name
        if e.names_runtime:  # `runtime: pytorch`: no profile moves it
            return e.runtime
        profiled = (profile_on(e, device) or BatchProfile()).runtime
        if profiled is not None and engines.engine(profiled).serves(e):
            return profiled
        return engines.DEFAULT

    return {e.id: runtime(e) for e in entries}
