"""The SGLang runtime: each model served by its own SGLang server, batching continuously.

`SGLangRuntime` (in `runtimes.sglang.runtime`) is imported lazily, so `import runtimes.sglang`
stays cheap. See docs/runtimes.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtimes.sglang.runtime import SGLangRuntime

__all__ = ["SGLangRuntime"]


def __getattr__(name: str) -> Any:
    if name == "SGLangRuntime":
        from runtimes.sglang.runtime import SGLangRuntime

        return SGLangRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
