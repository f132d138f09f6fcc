"""A worker's and a gateway's counters off their /metrics pages: device-busy seconds,
batches and their items of one model, and the task messages the gateway published with the
requests they carried (bench.device_feed, bench.gpu_stack)."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerCounters:
    device_busy_s: float
    batches: float
    batch_items: float
    at: float  # perf_counter when read
    messages: float = 0.0  # the gateway's published task messages
    messages_requests: float = 0.0  # and the requests they carried


def _samples(url: str, wanted: dict[str, float], model: str | None) -> dict[str, float]:
    """The named samples of a /metrics page summed (those of `model` only, if given)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and (model is None or sample.labels.get("model") == model):
                wanted[sample.name] += sample.value
    return wanted


def read_counters(metrics_url: str, model: str, gateway_url: str | None = None
                  ) -> WorkerCounters:
    """The worker's device-busy and batch counters of `model`, and the gateway's messages
    and the requests they carried, now."""
    worker = _samples(metrics_url, {"shoal_device_busy_seconds_total": 0.0,
                                    "shoal_batch_seconds_count": 0.0,
                                    "shoal_batch_items_sum": 0.0}, model)
    at = time.perf_counter()
    gateway = _samples(gateway_url, {"shoal_gateway_requests_per_message_count": 0.0,
                                     "shoal_gateway_requests_per_message_sum": 0.0}, None) \
        if gateway_url else {}
    return WorkerCounters(worker["shoal_device_busy_seconds_total"],
                          worker["shoal_batch_seconds_count"], worker["shoal_batch_items_sum"],
                          at, gateway.get("shoal_gateway_requests_per_message_count", 0.0),
                          gateway.get("shoal_gateway_requests_per_message_sum", 0.0))


async def counters_over(metrics_url: str, model: str, start: float, end: float,
                        gateway_url: str | None = None
                        ) -> tuple[WorkerCounters, WorkerCounters]:
    """The counters at `start` and at `end` (perf_counter instants), read off the loop."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    before = await asyncio.to_thread(read_counters, metrics_url, model, gateway_url)
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    after = await asyncio.to_thread(read_counters, metrics_url, model, gateway_url)
    return before, after
