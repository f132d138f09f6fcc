"""Prometheus metrics of the gateway, served on GET /metrics.

`shoal gateway --workers N` (N > 1) runs N processes and sets PROMETHEUS_MULTIPROC_DIR
before they start: prometheus_client then keeps every value in a file per process
there, and /metrics answers, whichever process serves it, with the counters and
histograms summed over all of them. A Gauge added here needs a `multiprocess_mode`
("livesum", "max", ...) to say how processes combine. One process (no folder) is
served from the default registry as before.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.requests import Request
from starlette.responses import Response

REQUESTS = Counter("shoal_gateway_requests_total", "HTTP requests", ["route", "status"])
UNEXPECTED_ERRORS = Counter(
    "shoal_gateway_unexpected_errors_total", "exceptions no handler expected (answered 500 "
    "INTERNAL, or a stream cut short); each is logged with its traceback", ["route"],
)
CLIENT_DISCONNECTS = Counter(
    "shoal_gateway_client_disconnects_total", "clients that left before their request body "
    "was read (nothing answered)", ["route"],
)
EDGE_REFUSALS = Counter(
    "shoal_gateway_edge_refusals_total", "connections the HTTP edge ended before the app saw "
    "a request: headers_too_large (431), header_timeout, body_timeout (408), "
    "connection_cap (503 at accept)", ["reason"],
)
EDGE_SERVED = Counter(
    "shoal_gateway_edge_served_total", "responses of the hot routes written by the HTTP "
    "edge itself, without the ASGI stack (gateway.edge.hot_requests); the rest of "
    "shoal_gateway_requests_total went through it", ["route"],
)
# Quorum queues report no head message's age; the gateway knows when each request it awaits
# came in. The oldest per model is what an operator means by "how long has the oldest
# message waited", and unlike the queue wait of messages taken it grows while nothing is.
OLDEST_WAITING = Gauge(
    "shoal_gateway_oldest_waiting_seconds", "age of the oldest request this gateway awaits "
    "with nothing answered yet (queued, or held by a worker and not started streaming), by "
    "model; 0 when none", ["model"], multiprocess_mode="livemax",
)
CALLERS_LEFT = Counter(
    "shoal_gateway_callers_left_total", "requests whose caller hung up before its answer, "
    "by where the request was: outbox (never published) or published (revoked on every "
    "worker with shoal_cancel)", ["where"],
)
REVOKE_MESSAGES = Counter(
    "shoal_gateway_revoke_messages_total", "shoal_cancel broadcasts sent for callers that "
    "hung up (each carries the ids revoked in one turn of the loop)",
)
DUPLICATE_REPLIES = Counter(
    "shoal_gateway_duplicate_replies_total",
    "replies for requests already answered or given up (redeliveries, late results)",
)
REQUESTS_PER_MESSAGE = Histogram(
    "shoal_gateway_requests_per_message",
    "requests per published task message (more than one: coalesced while others waited)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
POOL_STATES = Counter(
    "shoal_gateway_pool_states_total",
    "pool-state messages from workers: kept, or dropped as malformed", ["outcome"],
)
CLAIMS = Counter(
    "shoal_gateway_claims_total", "binary parts moved to the blob store (claim checks): "
    "uploaded, or failed (the caller got 503 BLOB_STORE_UNAVAILABLE)", ["outcome"],
)
CLAIM_BYTES = Counter("shoal_gateway_claim_bytes_total", "bytes uploaded as claim checks")
CLAIM_UPLOAD_SECONDS = Histogram(
    "shoal_gateway_claim_upload_seconds", "from publishing a claim-checked request to the end "
    "of its upload", buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
BLOBS_SWEPT = Counter("shoal_gateway_blobs_swept_total",
                      "orphaned claim blobs (older than SHOAL_BLOB_TTL_S) deleted")
LATENCY = Histogram(
    "shoal_gateway_request_seconds", "HTTP request latency", ["route"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

_TOKEN_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TIME_TO_FIRST_TOKEN = Histogram(
    "shoal_gateway_time_to_first_token_seconds", "generate: from the request's arrival to "
    "its first token (streamed: the first chunk sent; else queue wait + the runtime's "
    "time to it)", ["model", "stream"], buckets=_TOKEN_SECONDS,
)
INTER_TOKEN = Histogram(
    "shoal_gateway_inter_token_seconds", "generate: time between tokens (streamed: between "
    "chunks per token in them; else the completion's mean)", ["model", "stream"],
    buckets=_TOKEN_SECONDS,
)


def _registry() -> CollectorRegistry:
    """The default registry, or one that reads every process's files (prometheus_client
    chose its mode from the same variable when it was imported)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry


_REGISTRY = _registry()


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_REGISTRY), media_type=CONTENT_TYPE_LATEST)
