"""Prometheus metrics of the gateway, served on GET /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response

REQUESTS = Counter("shoal_gateway_requests_total", "HTTP requests", ["route", "status"])
DUPLICATE_REPLIES = Counter(
    "shoal_gateway_duplicate_replies_total",
    "replies for requests already answered or given up (redeliveries, late results)",
)
REQUESTS_PER_MESSAGE = Histogram(
    "shoal_gateway_requests_per_message",
    "requests per published task message (more than one: coalesced while others waited)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
LATENCY = Histogram(
    "shoal_gateway_request_seconds", "HTTP request latency", ["route"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


async def metrics(request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
