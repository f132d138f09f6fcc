"""`SGLangRuntime`: models served by SGLang servers, one server per model, batching continuously.

The worker hands each request over as it comes (`submit`) while `load_of` says SGLang has
room; SGLang forms its own batches (continuous batching). This module runs in the
worker's venv and never imports sglang: it talks HTTP to servers started from SGLang's
own venv (`runtimes.sglang.server`).

Generate: prompts are tokenized here with the model's own tokenizer, by the very rules
of the PyTorch causal-lm adapter (`runtimes.families.prompts`), and SGLang gets token ids; the
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

The package, module by module: `runtime` (this one: `SGLangRuntime`, its
servers' life and the way in: submit, cancel, deadlines), `model` (a model's entry checked,
tokenizer, context and server settings; `ServedModel`), `prepare` (requests checked and
tokenized; each item's `/generate` body and sampling parameters), `live` (requests being
served, cancels), `recovery` (crashes: restart, retry alone, poison), `attempt` (one try on
the current server), `generate` (one item streamed: `GenerateItem`), `results` (choices,
results, shared failures), `client` (the HTTP client; `ServerDied`), `loads` (`load_of`),
`server` (one server process), `launch` (runs inside SGLang's venv).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from batching.feeder import Load
from runtimes.base import (
    Capabilities,
    LoadFailed,
    OnDeltas,
    Outcome,
    Request,
    SentAhead,
    failed,
)
from runtimes.model_files.footprint import UNKNOWN_BYTES, estimate_bytes
from runtimes.sglang.client import SGLangClient
from runtimes.sglang.live import Live, LiveRequests
from runtimes.sglang.loads import load_of
from runtimes.sglang.model import (
    ServedModel,
    ServerSettings,
    read_bounds,
    served_model,
    start_server,
)
from runtimes.sglang.prepare import prepare_soon
from runtimes.sglang.recovery import Recovery
from runtimes.sglang.results import deadline_exceeded
from runtimes.sglang.server import ServerStartError, SGLangServer
from tasks.catalog import load_catalog
from tasks.errors import ErrorCode, ShoalError
from tasks.served import stamp_batch
from tasks.sources import resolve_source

log = logging.getLogger(__name__)


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
        self.resident: dict[str, int] = {}
        self.device_bytes: int | None = None
        self.start_timeout = start_timeout
        self._catalog_dir = catalog_dir
        self._settings = ServerSettings.read(device, threads, env)
        self._models: dict[str, ServedModel] = {}
        self._live = LiveRequests()
        self._lock = threading.Lock()  # guards _models, resident, _closed
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="sglang-runtime-loop")
        self._thread.start()
        self._client: SGLangClient = self._call(self._make_client())
        self._recovery = Recovery(self._client, self._start_server, self._serving)
        try:
            for model in models:
                self.load(model)
        except BaseException:
            self.close()
            raise

    async def _make_client(self) -> SGLangClient:
        return SGLangClient()

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> SGLangRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- counters the worker's metrics read -----------------------------------------------

    @property
    def restarts(self) -> int:
        return self._recovery.restarts

    @property
    def poison_isolated(self) -> int:
        return self._recovery.poison_isolated

    # SGLang restarts a dead server in place: no spare to promote, no failed start counted.
    spare_promotions = 0
    start_failures = 0
    # It forms its own batches (`submit`): the worker hands it none, so one slot suffices,
    # and there is no frame to send ahead.
    capabilities = Capabilities()

    def ready_in(self, model_id: str) -> float | None:
        """None: a restarting server's requests wait for it (`Recovery`), none is refused."""
        return None

    def watch_availability(self, callback: Callable[[], None]) -> None:
        """Nothing to watch (`ready_in` is always None)."""

    @property
    def requests_sent(self) -> int:
        """HTTP requests that reached an SGLang server (generate/encode)."""
        return self._client.requests_sent

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
        weights take. `LoadFailed` with the reason if it cannot."""
        if lora is not None:
            raise LoadFailed(f"LoRA adapter {lora!r} of {model_id}: shoal's SGLang runtime "
                             "serves no LoRA adapters (serve the model with runtime: pytorch "
                             "for LoRA)")
        with self._lock:
            if self._closed:
                raise LoadFailed("the SGLang runtime is closed")
            if model_id in self._models:
                return self.resident.get(model_id, 0)
        try:
            model = served_model(self._catalog_dir, model_id, self._settings)
            server = self._start_server(model)
        except (ServerStartError, ShoalError, ValueError, OSError) as exc:
            raise LoadFailed(str(exc)) from exc
        model.server = server
        read_bounds(model)
        size = self.estimate_bytes(model_id)
        with self._lock:
            if self._closed:
                server.stop()
                raise LoadFailed("the SGLang runtime was closed while loading")
            self._models[model_id] = model
            self.resident[model_id] = 0 if size == UNKNOWN_BYTES else size
        return self.resident[model_id]

    def _start_server(self, model: ServedModel) -> SGLangServer:
        return start_server(model, self._settings.env, self.start_timeout,
                            closed=lambda: self._closed)

    def _serving(self, model: ServedModel) -> bool:
        """Whether `model` is still loaded in this runtime, and the runtime open."""
        return not self._closed and self._models.get(model.entry.id) is model

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

    def send_ahead(self, model_id: str, requests: list[Request]) -> SentAhead | None:
        return None

    def run_batch(self, model_id: str, requests: list[Request],
                  on_deltas: OnDeltas | None = None, ahead: SentAhead | None = None
                  ) -> list[Outcome]:
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
        return load_of(model, self._client, self._loop)

    # --- one request (on the loop) -------------------------------------------------------

    def _cancel(self, request_ids: list[str]) -> None:
        for live in self._live.cancel(request_ids):
            model = self._models.get(live.model)
            if model is not None:
                for rid in live.rids:
                    self._loop.create_task(self._client.abort(model, rid))

    async def _serve(self, model_id: str, request: Request,
                     on_deltas: OnDeltas | None) -> Outcome:
        started = time.perf_counter()
        model = self._models.get(model_id)
        if model is None:
            return failed(request.id, ErrorCode.MODEL_UNAVAILABLE,
                          f"model {model_id} is not loaded in the SGLang runtime")
        live = self._live.open(request, model_id)
        try:
            outcome = await self._within_deadline(model, request, live, on_deltas)
            if outcome.ok and outcome.result is not None:
                stamp_batch([outcome.result], model_id, [request.kwargs], started)
            return outcome
        finally:
            self._live.close(request.id)

    async def _within_deadline(self, model: ServedModel, request: Request, live: Live,
                               on_deltas: OnDeltas | None) -> Outcome:
        """The request checked, tokenized and served through crashes, unless its deadline
        passes first (then its SGLang requests are aborted: DEADLINE_EXCEEDED)."""
        if request.deadline_ms is not None and request.deadline_ms / 1000 - time.time() <= 0:
            return deadline_exceeded(request)
        try:
            prepared = await prepare_soon(model, request)
        except ShoalError as exc:
            return failed(request.id, exc.code, exc.message)
        work = self._recovery.serve(model, request, prepared, live, on_deltas)
        if request.deadline_ms is None:
            return await work
        remaining = request.deadline_ms / 1000 - time.time()
        try:
            return await asyncio.wait_for(work, max(remaining, 0.0))
        except TimeoutError:
            for rid in live.rids:
                await self._client.abort(model, rid)
            return deadline_exceeded(request)
