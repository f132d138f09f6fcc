"""The SGLang runtime: each model served by its own SGLang server, batching continuously.

`SGLangRuntime` (in `runtimes.sglang.runtime`) is imported lazily, so `import runtimes.sglang`
stays cheap; `start_runtime` is how a worker starts it (the registry's `start`,
`tasks.engines`). See docs/runtimes.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtimes.sglang.runtime import SGLangRuntime
    from tasks.catalog import ModelEntry
    from tasks.settings import Settings

__all__ = ["SGLangRuntime", "start_runtime"]


def start_runtime(entries: list[ModelEntry], pinned: list[str], settings: Settings
                  ) -> SGLangRuntime:
    """A `runtimes.base.StartRuntime`: the servers of the worker's SGLang models, the
    `pinned` ones started (the runtime reads every entry from the catalog itself)."""
    from runtimes.sglang.runtime import SGLangRuntime

    return SGLangRuntime(catalog_dir=settings.catalog_dir, models=pinned,
                         device=settings.device, threads=settings.torch_threads,
                         start_timeout=settings.runtime_start_timeout_s)


def __getattr__(name: str) -> Any:
    if name == "SGLangRuntime":
        from runtimes.sglang.runtime import SGLangRuntime

        return SGLangRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
