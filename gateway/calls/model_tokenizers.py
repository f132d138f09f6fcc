"""The models' tokenizers, in the gateway: what TEI's router does on its CPU (`/tokenize`,
`/decode`) and vLLM's `/v1/tokenize` answers, for clients that count or chunk by tokens.

A model's tokenizer is its `tokenizer.json`, read with the `tokenizers` library (Rust, no
transformers: the gateway imports nothing heavy), from where the catalog entry's `source`
says the weights are: a folder, an installed package, or a hub repository already in the
local Hugging Face cache. Nothing is downloaded: a gateway answers from what the machine
has, and a model whose files are not here gets a 503 that says which and why. Its
`tokenizer_config.json` (chat template, special tokens, `model_max_length`) and `config.json`
(`max_position_embeddings`, a classifier's labels) come with it.

Each model's tokenizer is loaded once, on first use, and kept. Loading and tokenizing run
on a small pool of threads (the Rust code releases the GIL), never on the event loop: a
long batch of texts does not stall the gateway's other requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gateway.edge.api_errors import ApiError
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode
from tasks.sources import SourceError, resolve_source

T = TypeVar("T")

# One thread per core, as TEI runs one tokenizer worker per core; at most 4, the gateway
# being one process among several on a host.
THREADS = max(1, min(4, os.cpu_count() or 1))
_POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="tokenizer")
_LOADED: dict[str, ModelTokenizer] = {}
_LOADING = threading.Lock()


@dataclass(slots=True)
class ModelTokenizer:
    """A model's tokenizer (no padding, no truncation: what a caller sent, whole) and the
    settings next to it."""

    model: str
    tokenizer: Any  # tokenizers.Tokenizer
    config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json
    model_config: dict[str, Any] = field(default_factory=dict)  # config.json

    def max_length(self, entry: ModelEntry) -> int | None:
        """The longest input the model takes: the entry's, else its files'."""
        if entry.max_seq_length is not None:
            return entry.max_seq_length
        for value in (self.model_config.get("max_position_embeddings"),
                      self.config.get("model_max_length")):
            if isinstance(value, int) and 0 < value < 10**8:  # 1e30: "no limit" in HF files
                return value
        return None

    def special_token(self, name: str) -> str | None:
        """`bos_token`, `eos_token`, ... as tokenizer_config.json gives it (a string or an
        AddedToken's dict)."""
        value = self.config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None


def _unavailable(model: str, why: str) -> ApiError:
    return ApiError(ErrorCode.MODEL_UNAVAILABLE,
                    f"the tokenizer of {model} cannot be loaded by this gateway: {why}")


def _files(entry: ModelEntry) -> Callable[[str], Path | None]:
    """The model's files by name (None: not there), from its folder: a path, an installed
    package, or a hub repository's snapshot in the local cache (`tasks.sources`, as the
    workers find their weights, here never downloading)."""
    try:
        folder = Path(resolve_source(entry.source, local_only=True))
    except SourceError as exc:
        hub = entry.source.hub
        raise _unavailable(entry.id, str(exc) if not hub else (
            f"the hub repository {hub} is not in this host's Hugging Face cache (the gateway "
            f"downloads nothing: fetch it once, e.g. `hf download {hub}`, or run the gateway "
            "where a worker has it)")) from None
    return lambda name: (folder / name) if (folder / name).is_file() else None


def _json(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _load(entry: ModelEntry) -> ModelTokenizer:
    from tokenizers import Tokenizer

    files = _files(entry)
    path = files("tokenizer.json")
    if path is None:
        raise _unavailable(entry.id, "its files have no tokenizer.json (a fast tokenizer's "
                           "file, which `tokenizer.save_pretrained` writes)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception on a bad file
        raise _unavailable(entry.id, f"{path} is not a tokenizer file it can read: {exc}") \
            from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return ModelTokenizer(entry.id, tokenizer, _json(files("tokenizer_config.json")),
                          _json(files("config.json")))


def _loaded(entry: ModelEntry) -> ModelTokenizer:
    found = _LOADED.get(entry.id)
    if found is None:
        with _LOADING:  # one load per model, however many requests wait for it
            found = _LOADED.get(entry.id)
            if found is None:
                found = _LOADED[entry.id] = _load(entry)
    return found


async def run_tokenizer(entry: ModelEntry, work: Callable[[ModelTokenizer], T]) -> T:
    """`work` on the model's tokenizer (loaded on first use) in the tokenizer threads."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, lambda: work(_loaded(entry)))
