"""The model runtime a worker starts: simulated, PyTorch, ONNX Runtime, SGLang, or several
behind a router (by model). Its own process(es), started with the pinned models loaded."""

from __future__ import annotations

import logging

from runtimes.base import Runtime
from runtimes.worker_side.process import ProcessRuntime
from runtimes.worker_side.replicas import ReplicaSet, default_replicas
from tasks.catalog import ONNX_ADAPTERS, ModelEntry
from tasks.precision import precisions_of
from tasks.settings import Settings

log = logging.getLogger(__name__)


def start_runtime(entries: list[ModelEntry], pinned: set[str], settings: Settings,
                  chunk_tokens: int) -> Runtime:
    """The runtime of SHOAL_RUNTIME, the pinned models loaded (`chunk_tokens`: the most
    tokens a batch of any served model holds)."""
    if settings.runtime == "sim":
        # Imported here: a real worker never loads it, a simulated one never loads torch.
        from runtimes.doubles.sim import SimRuntime

        log.warning("SIMULATED runtime: no model runs; %s batches sleep as a %s would "
                    "(speed x%g) and results are fake", [e.id for e in entries],
                    settings.device, settings.sim_speed)
        return SimRuntime(entries, settings.device, settings.sim_speed,
                          settings.sim_constants, loaded=sorted(pinned))
    return _real_runtime(entries, pinned, settings, chunk_tokens)


def _real_runtime(entries: list[ModelEntry], pinned: set[str], settings: Settings,
                  chunk_tokens: int) -> Runtime:
    """The PyTorch and ONNX runtime processes, SGLang servers, or several behind a router
    (by model). The two runtime processes share the worker's memory budget through the
    placement, which counts each model's bytes wherever it lives."""
    on = runtime_of_models(entries, settings.runtime)
    runtimes: dict[str, Runtime] = {}
    for engine in ("pytorch", "onnx"):
        if engine not in on.values():
            continue
        # A worker-wide format applies to the runtime that has it (int8: ONNX only).
        precision = settings.precision if settings.precision in precisions_of(engine) \
            else None
        runtimes[engine] = _process_runtimes(
            settings, engine, precision, chunk_tokens,
            [e.id for e in entries if e.id in pinned and on[e.id] == engine])
    if "sglang" in on.values():
        from runtimes.sglang import SGLangRuntime

        runtimes["sglang"] = SGLangRuntime(
            catalog_dir=settings.catalog_dir,
            models=[e.id for e in entries if e.id in pinned and on[e.id] == "sglang"],
            device=settings.device, threads=settings.torch_threads,
            start_timeout=settings.runtime_start_timeout_s)
    if len(runtimes) == 1:
        return next(iter(runtimes.values()))
    from runtimes.worker_side.router import RuntimeRouter

    return RuntimeRouter(runtimes, on)


def _process_runtimes(settings: Settings, engine: str, precision: str | None,
                      chunk_tokens: int, models: list[str]) -> ProcessRuntime | ReplicaSet:
    """The runtime process of `engine`, or SHOAL_RUNTIME_REPLICAS of them on the device."""
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
            answer_while_restarting=True)

    replicas = settings.runtime_replicas
    count = default_replicas(settings.device) if replicas == "auto" else replicas
    if count == 1:
        return start(0)
    log.info("%s: %d runtime processes on %s (SHOAL_RUNTIME_REPLICAS=%s)", engine, count,
             settings.device, replicas)
    return ReplicaSet(start, count)


def runtime_of_models(entries: list[ModelEntry], worker_runtime: str) -> dict[str, str]:
    """Which runtime serves each model: the entry's `runtime` when it is not the default;
    with SHOAL_RUNTIME=sglang also every causal LM and last-token-pooled (decoder)
    embedder, the models SGLang is built for (an encoder such as MiniLM stays on PyTorch
    unless its entry says otherwise); with SHOAL_RUNTIME=onnx every entry of a family ONNX
    Runtime serves that has no LoRA adapters; else PyTorch."""
    def on_sglang(e: ModelEntry) -> bool:
        return e.adapter == "causal-lm" or (e.adapter == "dense" and e.pooling == "lasttoken")

    def on_onnx(e: ModelEntry) -> bool:
        return e.adapter in ONNX_ADAPTERS and not e.loras

    def runtime(e: ModelEntry) -> str:
        if e.runtime != "pytorch":
            return e.runtime
        if worker_runtime == "sglang" and on_sglang(e):
            return "sglang"
        if worker_runtime == "onnx" and on_onnx(e):
            return "onnx"
        return "pytorch"

    return {e.id: runtime(e) for e in entries}
