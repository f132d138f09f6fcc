"""One model served by SGLang: its catalog entry checked for SGLang, its tokenizer and context
length, how its server is started (`ServerSettings`, read from the environment), and the
state the runtime keeps for it while it is loaded (`ServedModel`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batching.feeder import Load
from runtimes.families.prompts import bos_id
from runtimes.families.token_ids import Vocabulary, vocabulary
from runtimes.sglang.server import PortTaken, ServerConfig, SGLangServer
from tasks.catalog import ModelEntry, load_catalog
from tasks.sources import resolve_source

log = logging.getLogger(__name__)

ADAPTERS = ("causal-lm", "dense")
_NO_LIMIT = 10**9


@dataclass(frozen=True)
class ServerSettings:
    """How this runtime starts its SGLang servers: `device` "cpu" or "cuda", `threads` (>0:
    the CPU server's OMP threads), `env` added to the servers' environment, and the
    SHOAL_SGLANG_* settings read from `env` first, then from the worker's own environment."""

    device: str
    threads: int
    env: dict[str, str]
    max_total_tokens: int
    max_running: str | None
    log_level: str

    @classmethod
    def read(cls, device: str, threads: int,
             env: Mapping[str, str] | None) -> ServerSettings:
        own = dict(env or {})
        setting = {**os.environ, **own}
        return cls(device=device, threads=threads, env=own,
                   max_total_tokens=int(setting.get("SHOAL_SGLANG_MAX_TOTAL_TOKENS", "4096")),
                   max_running=setting.get("SHOAL_SGLANG_MAX_RUNNING"),
                   log_level=setting.get("SHOAL_SGLANG_LOG_LEVEL", "warning"))


class ServedModel:
    """One loaded model: its entry, tokenizer and current server."""

    def __init__(self, entry: ModelEntry, path: str, tokenizer: Any, config: ServerConfig,
                 context: int) -> None:
        self.entry = entry
        self.path = path
        self.tokenizer = tokenizer
        self.tokenizer_lock = threading.Lock()  # a fast tokenizer is not re-entrant
        self.bos = bos_id(tokenizer) if entry.operation == "generate" else None
        self.config = config
        self.context = context
        self.server: SGLangServer | None = None
        self.incarnation = 0
        self.broken: str | None = None  # why the last restart failed
        self.max_running = 0
        self.max_tokens = 0
        self.inflight = 0  # items sent to SGLang and not finished
        self.isolating = 0  # requests waiting to be retried alone after a death
        self.restart_lock = asyncio.Lock()
        self.alone = asyncio.Lock()
        self.calm = asyncio.Condition()  # notified when `isolating` drops
        self.load_cache: tuple[float, Load] | None = None
        self.load_refreshing = False  # a /v1/loads read is under way
        self._vocab: Vocabulary | None = None

    def vocabulary(self) -> Vocabulary:
        """Which ids a tokens item may hold and how they are cut (`runtimes.families.token_ids`),
        read from the tokenizer on first use; call it holding `tokenizer_lock`."""
        if self._vocab is None:
            self._vocab = vocabulary(self.tokenizer)
        return self._vocab

    @property
    def generate(self) -> bool:
        return self.entry.operation == "generate"

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)


def checked_entry(catalog_dir: Path | str, model_id: str) -> ModelEntry:
    """The model's catalog entry, if SGLang can serve it as the entry says (ValueError why
    not)."""
    entry = load_catalog(catalog_dir).get(model_id)
    if entry is None:
        raise ValueError(f"model {model_id} is not in the catalog")
    if entry.adapter not in ADAPTERS:
        raise ValueError(f"{model_id} has adapter {entry.adapter!r}; the SGLang runtime "
                         f"serves {list(ADAPTERS)}")
    if entry.adapter == "dense" and entry.pooling != "lasttoken":
        raise ValueError(f"{model_id}: SGLang embeds with the last token's state; an entry "
                         "served on SGLang must say pooling: lasttoken")
    if entry.adapter == "dense" and entry.normalize is False:
        raise ValueError(f"{model_id}: SGLang returns normalised embeddings; an entry served "
                         "on SGLang cannot say normalize: false")
    return entry


def context_length(entry: ModelEntry, tokenizer: Any, config: Any) -> int:
    """The longest input the model takes: the entry's max_seq_length (else the tokenizer's
    model_max_length, when it sets one), bounded by the model's position embeddings."""
    limit = entry.max_seq_length
    if limit is None and tokenizer.model_max_length < _NO_LIMIT:
        limit = tokenizer.model_max_length
    positions = getattr(config, "max_position_embeddings", None)
    limits = [n for n in (limit, positions) if n]
    return min(limits) if limits else 512


def served_model(catalog_dir: Path | str, model_id: str,
                 settings: ServerSettings) -> ServedModel:
    """The model ready to start: entry checked, tokenizer loaded, server configured."""
    from transformers import AutoConfig, AutoTokenizer

    entry = checked_entry(catalog_dir, model_id)
    path = resolve_source(entry.source)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    context = context_length(entry, tokenizer, config)
    extra: list[str] = []
    if settings.max_running:
        extra += ["--max-running-requests", str(settings.max_running)]
    server = ServerConfig(
        model_path=path, served_name=model_id, device=settings.device,
        embedding=entry.operation == "encode", threads=settings.threads,
        max_total_tokens=settings.max_total_tokens, log_level=settings.log_level,
        extra_args=tuple(extra))
    return ServedModel(entry, path, tokenizer, server, context)


# Starts on a fresh port after the one chosen was taken before the server bound it.
PORT_ATTEMPTS = 3


def start_server(model: ServedModel, env: Mapping[str, str], timeout: float,
                 closed: Callable[[], bool]) -> SGLangServer:
    """A new server for the model, healthy (stopped again if it does not become so); on
    another port if the one chosen was taken meanwhile, within the same `timeout`."""
    deadline = time.monotonic() + timeout
    for attempt in range(1, PORT_ATTEMPTS + 1):
        server = SGLangServer(model.config, env)
        try:
            server.wait_healthy(max(1.0, deadline - time.monotonic()), closed=closed)
        except PortTaken:
            server.stop()
            if attempt == PORT_ATTEMPTS:
                raise
            log.warning("port %d was taken before the SGLang server for %s bound it; "
                        "starting it on another", server.port, model.entry.id)
            continue
        except BaseException:
            server.stop()
            raise
        return server
    raise AssertionError("unreachable")


def read_bounds(model: ServedModel) -> None:
    """The running-request and KV-token bounds the model's new server reports, if it does."""
    import httpx

    assert model.server is not None
    with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
        load = httpx.get(f"{model.server.url}/v1/loads", timeout=10).json()["loads"][0]
        model.max_running = int(load["max_running_requests"])
        model.max_tokens = int(load["max_total_num_tokens"])
