"""The gateway's Starlette app: `uvicorn gateway.app:create_app --factory`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.catalog import load_catalog
from app.settings import Settings, get_settings
from gateway.auth import install_auth
from gateway.broker import Broker
from gateway.claims import sweep_forever
from gateway.codecs import encode_response
from gateway.completions import create_chat_completion, create_completion
from gateway.embeddings import create_embeddings
from gateway.health import healthz, list_models, readyz
from gateway.job_driver import JobDriver
from gateway.job_replies import JobReplies
from gateway.job_store import JobStore
from gateway.jobs import cancel_job, create_job, get_job, get_result
from gateway.metrics import LATENCY, REQUESTS, metrics
from gateway.native import classify, encode, extract, score
from tasks.errors import ErrorCode, ShoalError

log = logging.getLogger(__name__)


def _error_response(request: Request, error: ShoalError) -> Response:
    headers = {"X-Request-Id": getattr(request.state, "request_id", "")}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return encode_response(request, error.body(), error.status, headers)


async def _on_shoal_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ShoalError)
    return _error_response(request, exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(
        exc.status_code, ErrorCode.INVALID_REQUEST
    )
    error = ShoalError(code, f"{request.method} {request.url.path}: {exc.detail}")
    error.status = exc.status_code
    return _error_response(request, error)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    if _redis_unreachable(exc):  # the jobs' state: the caller may retry, nothing is lost
        log.warning("%s %s: Redis is not reachable: %s", request.method, request.url.path, exc)
        return _error_response(request, ShoalError(
            ErrorCode.JOB_STORE_UNAVAILABLE, "the job store (Redis, SHOAL_REDIS_URL) is not "
            "reachable; retry later", retry_after=1))
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error_response(request, ShoalError(ErrorCode.INTERNAL, "internal error; see the "
                                             "gateway's log"))


def _redis_unreachable(exc: Exception) -> bool:
    # By module and name, not class: redis is imported only once a job route needs it.
    return type(exc).__module__.startswith("redis") and type(exc).__name__ in (
        "ConnectionError", "TimeoutError", "BusyLoadingError")


_FIXED_ROUTES = {"/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/models",
                 "/v1/jobs", "/healthz", "/readyz", "/metrics"}
_MODEL_ROUTES = ("encode", "score", "extract", "classify")


def _route_label(path: str) -> str:
    """A bounded metrics label: the route template, never a caller's path."""
    if path in _FIXED_ROUTES:
        return path
    for op in _MODEL_ROUTES:
        if path.startswith(f"/v1/{op}/"):
            return f"/v1/{op}/{{model}}"
    return "other"


class RequestIdMiddleware:
    """Echo or assign X-Request-Id and count every response by route and status."""

    def __init__(self, app) -> None:
        self.app = app
        # (route, status) -> its counter and latency histogram (labels() takes a lock)
        self._series: dict[tuple[str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value.decode("latin-1")
        request_id = request_id or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        route = _route_label(scope["path"])

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message["headers"] = headers
                key = (route, message["status"])
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = (REQUESTS.labels(route, str(key[1])),
                                                  LATENCY.labels(route))
                series[0].inc()
                series[1].observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or get_settings()
    catalog = load_catalog(settings.catalog_dir)
    # Every catalog model the deployment allows, whether or not a worker has it loaded
    # (SHOAL_MODELS is the workers' list); a model's queue is declared on first use.
    served = {entry.id: entry for entry in catalog.select(settings.gateway_models)}
    broker = Broker(settings, list(served))
    job_store = JobStore(settings.redis_url, settings.queue_prefix, settings.job_ttl_s)

    def blobs() -> Any:
        from tasks.blobs import blob_store  # fsspec: imported when a job needs it

        return blob_store(settings.blob_url)

    job_driver = JobDriver(settings, job_store, broker, served, blobs)
    job_replies = JobReplies(job_store, settings.queue_prefix, blobs, job_driver.notify)
    broker.on_connect.append(job_replies.attach)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        broker.start()
        job_driver.start()
        # Orphaned claim blobs (requests dead-lettered or lost) go after SHOAL_BLOB_TTL_S.
        sweeper = asyncio.get_running_loop().create_task(sweep_forever(
            settings.blob_url, settings.blob_ttl_s, settings.blob_sweep_interval_s))
        yield
        sweeper.cancel()
        await job_driver.close()
        await broker.close()
        await job_store.close()

    app = Starlette(
        routes=[
            Route("/v1/embeddings", create_embeddings, methods=["POST"]),
            Route("/v1/encode/{model:path}", encode, methods=["POST"]),
            Route("/v1/score/{model:path}", score, methods=["POST"]),
            Route("/v1/extract/{model:path}", extract, methods=["POST"]),
            Route("/v1/classify/{model:path}", classify, methods=["POST"]),
            Route("/v1/completions", create_completion, methods=["POST"]),
            Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
            Route("/v1/jobs", create_job, methods=["POST"]),
            Route("/v1/jobs/{job_id}", get_job, methods=["GET"]),
            Route("/v1/jobs/{job_id}", cancel_job, methods=["DELETE"]),
            Route("/v1/jobs/{job_id}/result", get_result, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={
            ShoalError: _on_shoal_error,
            HTTPException: _on_http_error,
            Exception: _on_unexpected,
        },
        lifespan=lifespan,
    )
    install_auth(app, settings)  # inside RequestIdMiddleware: a refusal is counted too
    app.add_middleware(RequestIdMiddleware)
    app.state.settings = settings
    app.state.served = served
    app.state.catalog = catalog
    app.state.broker = broker
    app.state.job_store = job_store
    app.state.job_driver = job_driver
    return app
