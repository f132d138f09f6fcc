"""The model runtime a worker starts: simulated, PyTorch, SGLang, or both behind a router
(by model). Its own process(es), started with the pinned models loaded."""

from __future__ import annotations

import logging
from typing import Any

from runtimes.process import ProcessRuntime
from tasks.catalog import ModelEntry
from tasks.settings import Settings

log = logging.getLogger(__name__)


def start_runtime(entries: list[ModelEntry], pinned: set[str], settings: Settings,
                  chunk_tokens: int) -> Any:
    """The runtime of SHOAL_RUNTIME, the pinned models loaded (`chunk_tokens`: the most
    tokens a batch of any served model holds)."""
    if settings.runtime == "sim":
        # Imported here: a real worker never loads it, a simulated one never loads torch.
        from runtimes.sim import SimRuntime

        log.warning("SIMULATED runtime: no model runs; %s batches sleep as a %s would "
                    "(speed x%g) and results are fake", [e.id for e in entries],
                    settings.device, settings.sim_speed)
        return SimRuntime(entries, settings.device, settings.sim_speed,
                          settings.sim_constants, loaded=sorted(pinned))
    return _real_runtime(entries, pinned, settings, chunk_tokens)


def _real_runtime(entries: list[ModelEntry], pinned: set[str], settings: Settings,
                  chunk_tokens: int) -> Any:
    """The PyTorch runtime, SGLang servers, or both behind a router (by model)."""
    on = runtime_of_models(entries, settings.runtime)
    runtimes: dict[str, Any] = {}
    if "pytorch" in on.values():
        runtimes["pytorch"] = ProcessRuntime(
            catalog_dir=settings.catalog_dir,
            models=[e.id for e in entries if e.id in pinned and on[e.id] == "pytorch"],
            device=settings.device,
            threads=settings.torch_threads,
            chunk_tokens=chunk_tokens,
            start_timeout=settings.runtime_start_timeout_s,
            batch_timeout=settings.runtime_batch_timeout_s,
            spare=settings.runtime_spare,
            precision=settings.precision,
            pipeline_depth=settings.runtime_pipeline_depth,
        )
    if "sglang" in on.values():
        from runtimes.sglang import SGLangRuntime

        runtimes["sglang"] = SGLangRuntime(
            catalog_dir=settings.catalog_dir,
            models=[e.id for e in entries if e.id in pinned and on[e.id] == "sglang"],
            device=settings.device, threads=settings.torch_threads,
            start_timeout=settings.runtime_start_timeout_s)
    if len(runtimes) == 1:
        return next(iter(runtimes.values()))
    from runtimes.router import RuntimeRouter

    return RuntimeRouter(runtimes, on)


def runtime_of_models(entries: list[ModelEntry], worker_runtime: str) -> dict[str, str]:
    """Which runtime serves each model: the entry's `runtime: sglang`; with
    SHOAL_RUNTIME=sglang also every causal LM and last-token-pooled (decoder) embedder, the
    models SGLang is built for (an encoder such as MiniLM stays on PyTorch unless its entry
    says otherwise); else PyTorch."""
    def on_sglang(e: ModelEntry) -> bool:
        return e.adapter == "causal-lm" or (e.adapter == "dense" and e.pooling == "lasttoken")

    return {e.id: "sglang" if e.runtime == "sglang" or (
        worker_runtime == "sglang" and on_sglang(e)) else "pytorch" for e in entries}
