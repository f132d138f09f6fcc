"""`SGLangRuntime`: models served by SGLang servers, one server per model, batching continuously.

The worker hands each request over as it comes (`submit`) while `load_of` says SGLang has
room; SGLang forms its own batches (continuous batching). This module runs in the
worker's venv and never imports sglang: it talks HTTP to servers started from SGLang's
own venv (`runtimes.sglang.server`).

Generate: prompts are tokenized here with the model's own tokenizer, by the very rules
of the PyTorch causal-lm adapter (`runtimes.prompts`), and SGLang gets token ids; the
completion's text is decoded here from the token ids SGLang returns, as the adapter
decodes it, so both runtimes give the same text for the same tokens. Each item of a
request is its own SGLang request, rid "{request id}/{index}", streamed from the native
`/generate` API. A prompt whose completion would not fit the context is answered
INPUT_TOO_LONG without reaching SGLang.

Encode (`adapter: dense`): the server runs `--is-embedding`; SGLang pools the last
token and normalises, so an entry must say `pooling: lasttoken` (and not `normalize: false`).

Crashes. A server that dies (kill -9, OOM, a poison input) is restarted once per death.
Requests in flight then: one that already streamed deltas to its caller fails (STREAM_INTERRUPTED,
"the SGLang server died mid-generation"), as its caller holds text no retry would repeat;
every other one is retried once after the restart, alone (one at a time, new requests
wait). One that kills the server again when run alone is answered POISON_INPUT, provided
the restarted server answers a known-good request (the probe); otherwise it is not
blamed and fails INTERNAL. `restarts` and `poison_isolated` count them.

All HTTP runs on one background thread with an asyncio loop and one `httpx.AsyncClient`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtimes.base import CANCELLED, Delta, Load, OnDeltas, Outcome, Request, failed
from runtimes.deltas import sendable
from runtimes.footprint import UNKNOWN_BYTES, estimate_bytes
from runtimes.prompts import bos_id, check_prompt, prompt_ids
from runtimes.sglang.server import ServerConfig, ServerStartError, SGLangServer
from runtimes.sources import resolve_source
from tasks.catalog import ModelEntry, load_catalog
from tasks.errors import ErrorCode, ShoalError
from tasks.served import stamp_batch

log = logging.getLogger(__name__)

STOP = "stop"
LENGTH = "length"
ADAPTERS = ("causal-lm", "dense")
LOAD_CACHE_S = 0.05  # load_of is asked often: SGLang's answer is reused this long
_NO_LIMIT = 10**9


class LoadFailed(RuntimeError):
    """A model could not be served by SGLang (the reason is the message)."""


def _load_failed() -> type[Exception]:
    """`runtimes.process.LoadFailed`, which the worker catches, when it can be imported."""
    try:
        from runtimes.process import LoadFailed as ProcessLoadFailed
    except Exception:  # pragma: no cover - the worker's module is always there
        return LoadFailed
    return ProcessLoadFailed


# Requests with at most this many characters of text are tokenized on the runtime's loop.
INLINE_PREPARE_CHARS = 4096


def _text_chars(kwargs: Any) -> int:
    items = kwargs.get("items") if isinstance(kwargs, dict) else None
    total = 0
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("text"), str):
            total += len(item["text"])
        for message in item.get("messages") or () if isinstance(item.get("messages"), list) \
                else ():
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                total += len(message["content"])
    return total


class _ServerDied(Exception):
    def __init__(self, incarnation: int, how: str) -> None:
        super().__init__(how)
        self.incarnation = incarnation
        self.how = how


def _sampling_seed(seed: int, index: int) -> int:
    """One seed per item, from the request's seed and the item's index (items of a seeded
    request differ from each other, not from one run to the next)."""
    import hashlib

    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass
class _Live:
    """A request being served: what `cancel` needs."""

    request: Request
    model: str
    rids: list[str] = field(default_factory=list)
    cancelled: bool = False
    streamed: bool = False  # deltas went to its caller


class _Model:
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
        self.eos_ids: frozenset[int] = frozenset()
        self.dense_normalize = True

    @property
    def generate(self) -> bool:
        return self.entry.operation == "generate"

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prepare(self, request: Request) -> Any:
        """The request checked and tokenized (ShoalError if it cannot be served)."""
        if request.op != self.entry.operation:
            raise ShoalError(ErrorCode.UNSUPPORTED_OPERATION,
                             f"{self.entry.id} serves '{self.entry.operation}', not "
                             f"'{request.op}'")
        parsed = self.entry.parse(request.kwargs)
        if getattr(parsed.options, "lora", None) is not None:
            raise ShoalError(ErrorCode.MODEL_UNAVAILABLE,
                             f"{self.entry.id} runs on SGLang, and shoal's SGLang runtime "
                             "serves no LoRA adapters; leave options.lora unset")
        with self.tokenizer_lock:
            if self.generate:
                prompts = []
                for i, item in enumerate(parsed.items):
                    ids = prompt_ids(self.tokenizer, self.bos, item, i, self.entry.id)
                    check_prompt(ids, i, parsed.options.max_tokens, self.context)
                    prompts.append(ids)
                return parsed, prompts
            from tasks.schema import check_encode_output

            check_encode_output(parsed.options, self.entry.id, "dense",
                                self.entry.dims or 0)
            prompt = (self.entry.prompts.query if parsed.options.is_query
                      else self.entry.prompts.document)
            texts = [prompt + t for t in parsed.texts]
            full = self.tokenizer(texts, truncation=False, padding=False)["input_ids"]
            if not parsed.options.truncate:
                for i, ids in enumerate(full):
                    if len(ids) > self.context:
                        raise ShoalError(
                            ErrorCode.INPUT_TOO_LONG,
                            f"items[{i}] has {len(ids)} tokens, over the model's "
                            f"{self.context}; shorten it or set options.truncate to true")
            tokens = self.tokenizer(texts, truncation=True, max_length=self.context,
                                    padding=False)["input_ids"]
            return parsed, tokens


class SGLangRuntime:
    """`runtimes.base.ContinuousRuntime` on SGLang servers; see the module doc.

    Same arguments as `ProcessRuntime`: `models` load at start; `device` "cpu" (SGLang's
    CPU path with the import-only kernel stub) or "cuda"; `threads` (>0) sets the CPU
    server's OMP threads; `env` is added to the servers' environment (SHOAL_SGLANG_PYTHON,
    SHOAL_SGLANG_MAX_TOTAL_TOKENS, SHOAL_SGLANG_MAX_RUNNING, ... are read from it first,
    then from the worker's own environment)."""

    def __init__(self, catalog_dir: Path | str, models: list[str], device: str = "cpu",
                 threads: int = 0, start_timeout: float = 300.0,
                 env: Mapping[str, str] | None = None) -> None:
        import os

        self.resident: dict[str, int] = {}
        self.device_bytes: int | None = None
        self.restarts = 0
        self.poison_isolated = 0
        self.requests_sent = 0  # HTTP requests that reached an SGLang server (generate/encode)
        self.start_timeout = start_timeout
        self._catalog_dir = catalog_dir
        self._device = device
        self._threads = threads
        self._env = dict(env or {})
        setting = {**os.environ, **self._env}
        self._max_total_tokens = int(setting.get("SHOAL_SGLANG_MAX_TOTAL_TOKENS", "4096"))
        self._max_running = setting.get("SHOAL_SGLANG_MAX_RUNNING")
        self._log_level = setting.get("SHOAL_SGLANG_LOG_LEVEL", "warning")
        self._models: dict[str, _Model] = {}
        self._live: dict[str, _Live] = {}
        self._cancelled_early: deque[str] = deque(maxlen=1024)  # cancels that came first
        self._lock = threading.Lock()  # guards _models, resident, _closed
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="sglang-runtime-loop")
        self._thread.start()
        self._client = self._call(self._make_client())
        try:
            for model in models:
                self.load(model)
        except BaseException:
            self.close()
            raise

    async def _make_client(self) -> Any:
        import httpx

        return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=64))

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> SGLangRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Runtime ----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The first loaded model's server (each model has its own; see `server_pids`)."""
        pids = self.server_pids()
        return next(iter(pids.values()), None)

    def server_pids(self) -> dict[str, int]:
        with self._lock:
            return {m: s.server.pid for m, s in self._models.items() if s.server is not None}

    def continuous(self, model_id: str) -> bool:
        return True

    def estimate_bytes(self, model_id: str, lora: str | None = None) -> int:
        entry = load_catalog(self._catalog_dir).get(model_id)
        if entry is None or lora is not None:
            return UNKNOWN_BYTES
        try:
            return estimate_bytes(resolve_source(entry.source, local_only=True))
        except Exception:
            return UNKNOWN_BYTES

    def load(self, model_id: str, lora: str | None = None) -> int:
        """Start the model's SGLang server and wait until it is healthy: the bytes its
        weights take. `runtimes.process.LoadFailed` with the reason if it cannot."""
        error = _load_failed()
        if lora is not None:
            raise error(f"LoRA adapter {lora!r} of {model_id}: shoal's SGLang runtime serves no "
                        "LoRA adapters (serve the model with runtime: pytorch for LoRA)")
        with self._lock:
            if self._closed:
                raise error("the SGLang runtime is closed")
            if model_id in self._models:
                return self.resident.get(model_id, 0)
        try:
            model = self._prepare_model(model_id)
            server = self._start_server(model)
        except (ServerStartError, ShoalError, ValueError, OSError) as exc:
            raise error(str(exc)) from exc
        model.server = server
        self._read_bounds(model)
        size = self.estimate_bytes(model_id)
        with self._lock:
            if self._closed:
                server.stop()
                raise error("the SGLang runtime was closed while loading")
            self._models[model_id] = model
            self.resident[model_id] = 0 if size == UNKNOWN_BYTES else size
        return self.resident[model_id]

    def _prepare_model(self, model_id: str) -> _Model:
        from transformers import AutoConfig, AutoTokenizer

        entry = load_catalog(self._catalog_dir).get(model_id)
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
        path = resolve_source(entry.source)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        limit = entry.max_seq_length
        if limit is None and tokenizer.model_max_length < _NO_LIMIT:
            limit = tokenizer.model_max_length
        positions = getattr(config, "max_position_embeddings", None)
        limits = [n for n in (limit, positions) if n]
        context = min(limits) if limits else 512
        extra: list[str] = []
        if self._max_running:
            extra += ["--max-running-requests", str(self._max_running)]
        server = ServerConfig(
            model_path=path, served_name=model_id, device=self._device,
            embedding=entry.operation == "encode", threads=self._threads,
            max_total_tokens=self._max_total_tokens, log_level=self._log_level,
            extra_args=tuple(extra))
        return _Model(entry, path, tokenizer, server, context)

    def _start_server(self, model: _Model) -> SGLangServer:
        server = SGLangServer(model.config, self._env)
        try:
            server.wait_healthy(self.start_timeout, closed=lambda: self._closed)
        except BaseException:
            server.stop()
            raise
        return server

    def _read_bounds(self, model: _Model) -> None:
        import httpx

        assert model.server is not None
        with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
            load = httpx.get(f"{model.server.url}/v1/loads", timeout=10).json()["loads"][0]
            model.max_running = int(load["max_running_requests"])
            model.max_tokens = int(load["max_total_num_tokens"])

    def unload(self, model_id: str, lora: str | None = None) -> None:
        if lora is not None:
            return
        with self._lock:
            model = self._models.pop(model_id, None)
            self.resident.pop(model_id, None)
        if model is not None and model.server is not None:
            model.server.stop()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            models = list(self._models.values())
            self._models.clear()
            self.resident.clear()
        for model in models:
            if model.server is not None:
                model.server.stop(grace=2.0)
        with contextlib.suppress(Exception):
            self._call(self._client.aclose(), timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None) -> list[Outcome]:
        futures = [self.submit(model_id, r, on_deltas) for r in requests]
        return [f.result() for f in futures]

    def submit(self, model_id: str, request: Request,
               on_deltas: OnDeltas | None = None) -> concurrent.futures.Future[Outcome]:
        out: concurrent.futures.Future[Outcome] = concurrent.futures.Future()

        def done(inner: concurrent.futures.Future[Outcome]) -> None:
            try:
                out.set_result(inner.result())
            except BaseException as exc:  # never raise: a failure is an outcome
                log.exception("SGLang request %s failed unexpectedly", request.id)
                out.set_result(failed(request.id, ErrorCode.INTERNAL,
                                      f"the SGLang runtime failed on this request: {exc!r}"))

        try:
            inner = asyncio.run_coroutine_threadsafe(
                self._serve(model_id, request, on_deltas), self._loop)
        except RuntimeError as exc:  # the loop is closed
            out.set_result(failed(request.id, ErrorCode.MODEL_UNAVAILABLE,
                                  f"the SGLang runtime is closed: {exc}"))
            return out
        inner.add_done_callback(done)
        return out

    def cancel(self, request_ids: list[str]) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._cancel, list(request_ids))

    def load_of(self, model_id: str) -> Load:
        """SGLang's running and waiting requests and KV tokens in use (`/v1/loads`), with
        the items this runtime sent that SGLang does not count yet as waiting. A model that
        is down or restarting reads as full.

        Never waits: the worker asks from its event loop. The last answer is returned, and
        one older than LOAD_CACHE_S is refreshed in the background for the next ask."""
        model = self._models.get(model_id)
        if model is None:
            return Load(running=0, waiting=0, max_running=0)
        cached = model.load_cache
        if (cached is None or time.monotonic() - cached[0] >= LOAD_CACHE_S) \
                and not model.load_refreshing:
            model.load_refreshing = True
            try:
                asyncio.run_coroutine_threadsafe(self._refresh_load(model), self._loop)
            except RuntimeError:  # the loop is closed
                model.load_refreshing = False
        if cached is not None:
            return cached[1]
        # Not read yet: what this runtime sent is all SGLang holds.
        return Load(running=model.inflight, waiting=0, max_running=max(model.max_running, 1),
                    max_tokens=model.max_tokens)

    async def _refresh_load(self, model: _Model) -> None:
        try:
            load = await self._fetch_load(model)
        except Exception:
            load = None
        finally:
            model.load_refreshing = False
        if load is None:
            full = max(model.max_running, 1)
            load = Load(running=full, waiting=model.inflight, max_running=full)
        model.load_cache = (time.monotonic(), load)

    async def _fetch_load(self, model: _Model) -> Load | None:
        server = model.server
        if server is None or model.restart_lock.locked() or model.isolating:
            return None
        response = await self._client.get(f"{server.url}/v1/loads", timeout=5.0)
        data = response.json()["loads"][0]
        running = int(data["num_running_reqs"])
        waiting = int(data["num_waiting_reqs"])
        unseen = max(0, model.inflight - running - waiting)
        return Load(running=running, waiting=waiting + unseen,
                    max_running=int(data.get("max_running_requests") or model.max_running),
                    tokens=int(data.get("num_total_tokens") or data.get("num_used_tokens") or 0),
                    max_tokens=int(data.get("max_total_num_tokens") or model.max_tokens))

    # --- one request (on the loop) -------------------------------------------------------

    def _cancel(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                self._cancelled_early.append(request_id)
                continue
            live.cancelled = True
            model = self._models.get(live.model)
            if model is not None:
                for rid in live.rids:
                    self._loop.create_task(self._abort(model, rid))

    async def _abort(self, model: _Model, rid: str) -> None:
        server = model.server
        if server is None:
            return
        with contextlib.suppress(Exception):
            await self._client.post(f"{server.url}/abort_request", json={"rid": rid},
                                    timeout=5.0)

    async def _serve(self, model_id: str, request: Request,
                     on_deltas: OnDeltas | None) -> Outcome:
        started = time.perf_counter()
        model = self._models.get(model_id)
        if model is None:
            return failed(request.id, ErrorCode.MODEL_UNAVAILABLE,
                          f"model {model_id} is not loaded in the SGLang runtime")
        live = _Live(request, model_id)
        if request.id in self._cancelled_early:
            live.cancelled = True
        self._live[request.id] = live
        try:
            remaining = None
            if request.deadline_ms is not None:
                remaining = request.deadline_ms / 1000 - time.time()
                if remaining <= 0:
                    return self._deadline(request)
            try:
                prepared = await self._prepare(model, request)
            except ShoalError as exc:
                return failed(request.id, exc.code, exc.message)
            work = self._recovering(model, request, prepared, live, on_deltas)
            if remaining is None:
                outcome = await work
            else:
                remaining = request.deadline_ms / 1000 - time.time()
                try:
                    outcome = await asyncio.wait_for(work, max(remaining, 0.0))
                except TimeoutError:
                    for rid in live.rids:
                        await self._abort(model, rid)
                    return self._deadline(request)
            if outcome.ok and outcome.result is not None:
                stamp_batch([outcome.result], model_id, [request.kwargs], started)
            return outcome
        finally:
            self._live.pop(request.id, None)

    async def _prepare(self, model: _Model, request: Request) -> Any:
        """Tokenize on this loop when the request is short (~40 us; the executor's hand-off
        cost 2.4 ms of a lone stream's time to first token, bench.sglang), else on a thread
        so that a long prompt does not stall the other streams."""
        if _text_chars(request.kwargs) <= INLINE_PREPARE_CHARS:
            return model.prepare(request)
        return await self._loop.run_in_executor(None, model.prepare, request)

    @staticmethod
    def _deadline(request: Request) -> Outcome:
        return failed(request.id, ErrorCode.DEADLINE_EXCEEDED,
                      "the request's deadline passed before it was answered; SGLang "
                      "stopped generating for it")

    async def _recovering(self, model: _Model, request: Request, prepared: Any, live: _Live,
                          on_deltas: OnDeltas | None) -> Outcome:
        async with model.calm:
            await model.calm.wait_for(lambda: model.isolating == 0)
        try:
            return await self._once(model, request, prepared, live, on_deltas)
        except _ServerDied as died:
            if live.streamed:
                return self._interrupted(model, request, died,
                                         "this request had already streamed part of its "
                                         "output, so it is not retried. The server is being "
                                         "restarted; send it again.")
            log.warning("SGLang server for %s died (%s) under request %s; retrying it alone "
                        "after the restart", model.entry.id, died.how, request.id)
            model.isolating += 1
            try:
                return await self._retry_alone(model, request, prepared, live, on_deltas,
                                               died)
            finally:
                model.isolating -= 1
                async with model.calm:
                    model.calm.notify_all()

    def _interrupted(self, model: _Model, request: Request, died: _ServerDied,
                     why: str) -> Outcome:
        """A streamed request whose server died: restart it (not awaited) and answer
        STREAM_INTERRUPTED, as its caller holds text a rerun would repeat."""
        self._loop.create_task(self._restart(model, died.incarnation))
        return failed(request.id, ErrorCode.STREAM_INTERRUPTED,
                      f"the SGLang server died mid-generation ({died.how}); {why}")

    async def _retry_alone(self, model: _Model, request: Request, prepared: Any, live: _Live,
                           on_deltas: OnDeltas | None, died: _ServerDied) -> Outcome:
        if not await self._restart(model, died.incarnation):
            return self._unavailable(model, request)
        async with model.alone:
            if (model.server is None or not model.server.alive()) \
                    and not await self._restart(model, model.incarnation):
                return self._unavailable(model, request)
            live.rids.clear()
            try:
                return await self._once(model, request, prepared, live, on_deltas)
            except _ServerDied as again:
                if live.streamed:
                    return self._interrupted(model, request, again,
                                             "again, while this request was retried alone; "
                                             "not retried further")
                if not await self._restart(model, again.incarnation):
                    return self._unavailable(model, request)
                problem = await self._probe(model)
                if problem is not None:
                    return failed(request.id, ErrorCode.INTERNAL,
                                  f"the SGLang server for {model.entry.id} died twice under "
                                  f"this request ({again.how}), but it also fails a "
                                  f"known-good request ({problem}); this request is not "
                                  "blamed")
                self.poison_isolated += 1
                log.error("request %s for %s isolated as poison: it killed the SGLang server "
                          "again when run alone", request.id, model.entry.id)
                return failed(request.id, ErrorCode.POISON_INPUT,
                              f"this request crashed the SGLang server ({again.how}) twice: "
                              "with other requests, then alone after a restart; it is not "
                              "retried (the other requests were served without it)")

    def _unavailable(self, model: _Model, request: Request) -> Outcome:
        return failed(request.id, ErrorCode.MODEL_UNAVAILABLE,
                      f"the SGLang server for {model.entry.id} died and could not be "
                      f"restarted: {model.broken}")

    async def _restart(self, model: _Model, incarnation: int) -> bool:
        """Replace the server of `incarnation` (once, whoever asks first): whether a healthy
        server runs now."""
        async with model.restart_lock:
            if model.incarnation != incarnation:
                return model.server is not None and model.broken is None
            old = model.server
            model.incarnation += 1
            model.load_cache = None
            if self._closed or self._models.get(model.entry.id) is not model:
                model.broken = "the model was unloaded or the runtime closed"
                return False
            if old is not None:
                await asyncio.to_thread(old.stop, 1.0)
            self.restarts += 1
            log.warning("restarting the SGLang server for %s (restart %d)", model.entry.id,
                        self.restarts)
            try:
                model.server = await asyncio.to_thread(self._start_server, model)
                model.broken = None
                return True
            except Exception as exc:
                model.server = None
                model.broken = str(exc)
                log.error("the SGLang server for %s could not be restarted: %s",
                          model.entry.id, exc)
                return False

    async def _probe(self, model: _Model) -> str | None:
        """None when the model answers a known-good request, else what went wrong."""
        from runtimes.pytorch.adapter import probe_kwargs
        from tasks.adapters import ADAPTERS as CONTRACTS

        contract = CONTRACTS[model.entry.adapter]
        request = Request("shoal-probe", model.entry.operation,
                          probe_kwargs(contract.operation, contract.inputs))
        try:
            prepared = await self._loop.run_in_executor(None, model.prepare, request)
            outcome = await self._once(model, request, prepared, _Live(request, ""), None)
        except _ServerDied as died:
            return f"the server died on the probe too ({died.how})"
        except Exception as exc:
            return repr(exc)
        return None if outcome.ok else f"{outcome.error_code}: {outcome.error_message}"

    async def _once(self, model: _Model, request: Request, prepared: Any, live: _Live,
                    on_deltas: OnDeltas | None) -> Outcome:
        """One attempt on the current server; _ServerDied if it dies meanwhile."""
        async with model.restart_lock:
            server, incarnation = model.server, model.incarnation
        if server is None:
            return self._unavailable(model, request)
        parsed, tokens = prepared
        if not model.generate:
            return await self._encode(model, server, incarnation, request, parsed, tokens,
                                      live)
        choices = await asyncio.gather(*(
            self._item(model, server, incarnation, request, parsed.options, ids, index, live,
                       on_deltas)
            for index, ids in enumerate(tokens)))
        errors = [c for c in choices if isinstance(c, Outcome)]
        if errors:
            return errors[0]
        prompt = sum(c["prompt_tokens"] for c in choices)
        completion = sum(c["completion_tokens"] for c in choices)
        # Latencies beside the choices, as the PyTorch adapter reports them.
        latency = [{"ttft_ms": c.pop("ttft_ms"), "itl_ms": c.pop("itl_ms")} for c in choices]
        return Outcome(request.id, result={"choices": list(choices), "latency": latency,
                                           "usage": {"tokens": prompt + completion,
                                                     "prompt_tokens": prompt,
                                                     "completion_tokens": completion}})

    async def _died_or_broke(self, server: SGLangServer, incarnation: int, request: Request,
                             what: str) -> Outcome:
        """After a broken connection: _ServerDied if the server is gone, else an outcome."""
        for _ in range(100):
            if not server.alive():
                server.reap_group()
                raise _ServerDied(incarnation, f"pid {server.pid} {server.describe_exit()}")
            await asyncio.sleep(0.05)
        return failed(request.id, ErrorCode.INTERNAL,
                      f"the SGLang server (pid {server.pid}) broke off the request: {what}")

    async def _item(self, model: _Model, server: SGLangServer, incarnation: int,
                    request: Request, options: Any, ids: list[int], index: int, live: _Live,
                    on_deltas: OnDeltas | None) -> dict[str, Any] | Outcome:
        import httpx

        rid = f"{request.id}/{index}"
        live.rids.append(rid)
        params: dict[str, Any] = {"max_new_tokens": options.max_tokens,
                                  "temperature": options.temperature, "top_p": options.top_p,
                                  "skip_special_tokens": True}
        if options.stop:
            params["stop"] = list(options.stop)
        if options.seed is not None:
            params["sampling_seed"] = _sampling_seed(options.seed, index)
        body = {"input_ids": ids, "sampling_params": params, "stream": True, "rid": rid}
        output: list[int] = []
        finish: dict[str, Any] | None = None
        sent = ""
        started = time.perf_counter()
        first_at = last_at = None
        if live.cancelled:
            return self._choice(model, index, ids, [], CANCELLED, options.stop, 0.0, 0.0)
        model.inflight += 1
        self.requests_sent += 1
        try:
            async with self._client.stream("POST", f"{server.url}/generate",
                                           json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:500]
                    return failed(request.id, ErrorCode.INTERNAL,
                                  f"SGLang refused items[{index}] ({response.status_code}): "
                                  f"{detail}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = chunk["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        return failed(request.id, ErrorCode.INTERNAL,
                                      f"SGLang failed items[{index}]: {message}")
                    ids_now = chunk.get("output_ids") or []
                    if len(ids_now) > len(output):
                        now = time.perf_counter()
                        first_at = first_at or now
                        last_at = now
                        output = list(ids_now)
                    finish = chunk.get("meta_info", {}).get("finish_reason") or finish
                    if request.stream and on_deltas is not None and finish is None:
                        sent = self._send(model, request, index, output, options.stop, sent,
                                          on_deltas, live, final=False)
        except (httpx.TransportError, httpx.StreamError) as exc:
            if not live.cancelled:
                return await self._died_or_broke(server, incarnation, request, repr(exc))
        finally:
            model.inflight -= 1
        if finish is None and not live.cancelled:
            return await self._died_or_broke(server, incarnation, request,
                                             "its stream ended without a finish reason")
        kind = (finish or {}).get("type")
        if live.cancelled and kind not in (STOP, LENGTH):
            reason = CANCELLED
        elif kind == LENGTH:
            reason = LENGTH
        elif kind == STOP:
            reason = STOP
        else:
            message = (finish or {}).get("message") or finish
            return failed(request.id, ErrorCode.INTERNAL,
                          f"SGLang aborted items[{index}]: {message}")
        ttft = (first_at - started) * 1000 if first_at else 0.0
        itl = ((last_at - first_at) * 1000 / (len(output) - 1)
               if first_at and last_at and len(output) > 1 else 0.0)
        choice = self._choice(model, index, ids, output, reason, options.stop, ttft, itl)
        if request.stream and on_deltas is not None:
            self._send(model, request, index, output, options.stop, sent, on_deltas, live,
                       final=True, text=choice["text"])
        return choice

    def _text(self, model: _Model, output: list[int], stops: tuple[str, ...]) -> str:
        """The completion's text as the PyTorch adapter makes it: decoded without special
        tokens, cut before the first stop string."""
        text = model.decode(output)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text

    def _choice(self, model: _Model, index: int, prompt: list[int], output: list[int],
                reason: str, stops: tuple[str, ...], ttft: float,
                itl: float) -> dict[str, Any]:
        return {"index": index, "text": self._text(model, output, stops),
                "finish_reason": reason, "prompt_tokens": len(prompt),
                "completion_tokens": len(output), "ttft_ms": round(ttft, 3),
                "itl_ms": round(itl, 3)}

    def _send(self, model: _Model, request: Request, index: int, output: list[int],
              stops: tuple[str, ...], sent: str, on_deltas: OnDeltas, live: _Live,
              final: bool, text: str | None = None) -> str:
        """Stream what the item gained since `sent`; the text streamed now."""
        if text is None:
            text = self._text(model, output, stops)
        now = sendable(text, sent, stops, final)
        if now == sent:
            if final and not text.startswith(sent):
                log.warning("streamed text of %s/%d is no prefix of its final text",
                            request.id, index)
            return sent
        text = now
        live.streamed = True
        try:
            on_deltas([Delta(request.id, index, text[len(sent):], len(output))])
        except Exception:
            log.exception("on_deltas failed for %s/%d", request.id, index)
        return text

    async def _encode(self, model: _Model, server: SGLangServer, incarnation: int,
                      request: Request, parsed: Any, tokens: list[list[int]],
                      live: _Live) -> Outcome:
        import httpx
        import numpy as np

        from runtimes.pytorch.vectors import dense_result

        rids = [f"{request.id}/{i}" for i in range(len(tokens))]
        live.rids.extend(rids)
        model.inflight += len(tokens)
        self.requests_sent += 1
        try:
            response = await self._client.post(f"{server.url}/encode",
                                               json={"input_ids": tokens, "rid": rids})
        except httpx.TransportError as exc:
            return await self._died_or_broke(server, incarnation, request, repr(exc))
        finally:
            model.inflight -= len(tokens)
        if response.status_code != 200:
            return failed(request.id, ErrorCode.INTERNAL,
                          f"SGLang refused the request ({response.status_code}): "
                          f"{response.text[:500]}")
        data = response.json()
        rows = data if isinstance(data, list) else [data]
        vectors = np.asarray([row["embedding"] for row in rows], dtype=np.float32)
        result = dense_result(vectors, parsed.options, True, sum(len(t) for t in tokens))
        return Outcome(request.id, result=result)
