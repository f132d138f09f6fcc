"""The gateway's Starlette app: `uvicorn gateway.app:create_app --factory`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gateway.auth.install import install_auth
from gateway.broker.link import Broker
from gateway.calls.blob_offload import sweep_forever
from gateway.edge.cors import install_cors
from gateway.edge.gateway_metrics import metrics
from gateway.edge.hot_requests import serve_hot
from gateway.edge.outer_middleware import RequestIdMiddleware
from gateway.edge.sigterm_drain import Drain
from gateway.edge.tracing import install as install_tracing
from gateway.jobs.driver import JobDriver
from gateway.jobs.part_replies import JobReplies
from gateway.jobs.store import JobStore, warn_if_jobs_are_volatile
from gateway.routes.cohere_embed import embed_v1 as cohere_embed_v1
from gateway.routes.cohere_embed import embed_v2 as cohere_embed_v2
from gateway.routes.completions import create_chat_completion, create_completion
from gateway.routes.embeddings import create_embeddings
from gateway.routes.hot_path import (
    EdgeRoutes,
    HotRoutes,
    error_response,
    http_error_response,
)
from gateway.routes.job_routes import cancel_job, create_job, get_job, get_result
from gateway.routes.native import classify, encode, extract, score
from gateway.routes.openai_batches import (
    cancel_batch,
    create_batch,
    list_batches,
    retrieve_batch,
)
from gateway.routes.openai_files import (
    create_file,
    delete_file,
    file_content,
    list_files,
    retrieve_file,
)
from gateway.routes.rerank import rerank
from gateway.routes.status import created_times, healthz, list_models, readyz, retrieve_model
from gateway.routes.tei import embed as tei_embed
from gateway.routes.tei import predict as tei_predict
from gateway.routes.tei import rerank as tei_rerank
from gateway.routes.tei_root import health as tei_health
from gateway.routes.tei_root import info as tei_info
from gateway.routes.tei_root import root as tei_root
from gateway.routes.tei_tokens import decode as tei_decode
from gateway.routes.tei_tokens import tokenize as tei_tokenize
from gateway.routes.tei_vectors import embed_all as tei_embed_all
from gateway.routes.tei_vectors import embed_sparse as tei_embed_sparse
from gateway.routes.tei_vectors import similarity as tei_similarity
from gateway.routes.vllm_tokens import create_detokenize, create_tokenize
from tasks import tracing
from tasks.catalog import load_catalog
from tasks.errors import ShoalError
from tasks.settings import Settings, get_settings

log = logging.getLogger(__name__)


async def _on_shoal_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ShoalError)
    return error_response(request, exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return http_error_response(request, exc)


class GatewayApp(Starlette):
    """Starlette without its outermost ServerErrorMiddleware: `RequestIdMiddleware`, just
    inside CORS, answers whatever escapes a handler (in the route's error shape, with the
    request's id), so Starlette's layer only added a coroutine and a send wrapper to every
    request (~2.5% of the gateway's CPU under single-text load)."""

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        return stack.app if isinstance(stack, ServerErrorMiddleware) else stack


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or get_settings()
    catalog = load_catalog(settings.catalog_dir)
    # Every catalog model the deployment allows, whether or not a worker has it loaded
    # (SHOAL_MODELS is the workers' list); a model's queue is declared on first use.
    served = {entry.id: entry for entry in catalog.select(settings.gateway_models)}
    broker = Broker(settings, list(served), {m: e.queue_type for m, e in served.items()})
    job_store = JobStore(settings.redis_url, settings.queue_prefix, settings.job_ttl_s)

    def blobs() -> Any:
        from tasks.blobs import blob_store  # fsspec: imported when a job needs it

        return blob_store(settings.blob_url)

    job_driver = JobDriver(settings, job_store, broker, served, blobs)
    job_replies = JobReplies(job_store, settings.queue_prefix, blobs, job_driver.notify)
    broker.on_connect.append(job_replies.attach)
    drain = Drain(settings.gateway_drain_delay_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # SIGTERM: /readyz says 503 while uvicorn drains (gateway.edge.sigterm_drain)
        drain.install()
        broker.start()
        job_driver.start()
        warned = asyncio.get_running_loop().create_task(warn_if_jobs_are_volatile(job_store))
        # Orphaned claim blobs (requests dead-lettered or lost) go after SHOAL_BLOB_TTL_S.
        sweeper = asyncio.get_running_loop().create_task(sweep_forever(
            settings.blob_url, settings.blob_ttl_s, settings.blob_sweep_interval_s))
        # Everything imported and built so far lives as long as the process: out of the
        # collector's sight, a full collection (which the requests in flight trigger now
        # and then) scans only what requests left behind, not every module and class.
        gc.freeze()
        yield
        # uvicorn runs this only once the requests in flight were answered (or the grace
        # ran out): the broker, which brings their replies, closes after them.
        sweeper.cancel()
        warned.cancel()
        await job_driver.close()
        await broker.close()
        await job_store.close()

    app = GatewayApp(
        routes=[
            Route("/v1/embeddings", create_embeddings, methods=["POST"]),
            Route("/v1/encode/{model:path}", encode, methods=["POST"]),
            Route("/v1/score/{model:path}", score, methods=["POST"]),
            Route("/v1/extract/{model:path}", extract, methods=["POST"]),
            Route("/v1/classify/{model:path}", classify, methods=["POST"]),
            Route("/v1/rerank", rerank, methods=["POST"]),  # Cohere's and Jina's shape
            Route("/v2/rerank", rerank, methods=["POST"]),  # Cohere's v2 client posts here
            Route("/v2/embed", cohere_embed_v2, methods=["POST"]),  # Cohere's embed
            Route("/v1/embed", cohere_embed_v1, methods=["POST"]),
            Route("/embed", tei_embed, methods=["POST"]),  # TEI's routes
            Route("/rerank", tei_rerank, methods=["POST"]),
            Route("/predict", tei_predict, methods=["POST"]),
            Route("/embed_sparse", tei_embed_sparse, methods=["POST"]),
            Route("/embed_all", tei_embed_all, methods=["POST"]),
            Route("/similarity", tei_similarity, methods=["POST"]),
            Route("/tokenize", tei_tokenize, methods=["POST"]),
            Route("/decode", tei_decode, methods=["POST"]),
            Route("/info", tei_info, methods=["GET"]),
            Route("/health", tei_health, methods=["GET"]),
            Route("/", tei_health, methods=["GET"]),  # TEI's Inference API probe
            Route("/", tei_root, methods=["POST"]),  # by the body's shape and model's kind
            Route("/invocations", tei_root, methods=["POST"]),  # SageMaker's path for it
            Route("/v1/tokenize", create_tokenize, methods=["POST"]),  # vLLM's token routes
            Route("/v1/detokenize", create_detokenize, methods=["POST"]),
            Route("/v1/completions", create_completion, methods=["POST"]),
            Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
            Route("/v1/jobs", create_job, methods=["POST"]),
            Route("/v1/jobs/{job_id}", get_job, methods=["GET"]),
            Route("/v1/jobs/{job_id}", cancel_job, methods=["DELETE"]),
            Route("/v1/jobs/{job_id}/result", get_result, methods=["GET"]),
            # OpenAI's files and Batch API, over the jobs (gateway.routes.openai_batches)
            Route("/v1/files", create_file, methods=["POST"]),
            Route("/v1/files", list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
            Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
            Route("/v1/batches", create_batch, methods=["POST"]),
            Route("/v1/batches", list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            # ids contain "/" (the openai SDK sends it as %2F; the path arrives decoded)
            Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={
            ShoalError: _on_shoal_error,
            HTTPException: _on_http_error,
        },
        lifespan=lifespan,
    )
    # Innermost of the gateway's middleware: the keys and the request ids apply first.
    app.add_middleware(HotRoutes, exact={"/v1/embeddings": create_embeddings},
                       prefixed={"/v1/encode/": encode, "/v1/score/": score})
    install_auth(app, settings)  # inside RequestIdMiddleware: a refusal is counted too
    app.add_middleware(RequestIdMiddleware)
    install_cors(app, settings)  # outermost: preflights before the keys, headers on errors
    if tracing.ENABLED:  # around even CORS: a request's server span covers all it met
        install_tracing(app)
    if settings.api_keys_file is None and not tracing.ENABLED:
        # The hot routes answered by the HTTP edge itself (gateway.edge.hot_requests says
        # what goes on to the ASGI stack above): keys' rate limits await Redis, and the
        # server spans are ASGI middleware, so with either on every request goes there.
        serve_hot(app, EdgeRoutes(settings))
    app.state.settings = settings
    app.state.served = served
    app.state.catalog = catalog
    app.state.model_created = created_times(catalog, served)  # /v1/models' `created`
    app.state.broker = broker
    app.state.drain = drain
    app.state.job_store = job_store
    app.state.job_driver = job_driver
    return app
