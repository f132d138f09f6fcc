"""Prometheus metrics of a worker (served on its /metrics by `app.worker.health`)."""

from __future__ import annotations

from typing import Any

import prometheus_client


class _CachedLabels:
    """`labels(...)` as a dict lookup once a label set was seen: prometheus_client's takes
    a lock and formats every value on each call, and the worker's loop calls it several
    times per request (a batch of 64 single-text requests: hundreds of times). Children
    are never removed here but by `remove`/`clear`, which drop the cache with them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._children: dict[tuple[Any, ...], Any] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: Any, **named: Any) -> Any:
        if named:
            return super().labels(*values, **named)  # type: ignore[misc]
        try:
            return self._children[values]
        except KeyError:
            child = super().labels(*values)  # type: ignore[misc]
            self._children[values] = child
            return child

    def remove(self, *values: Any) -> None:
        self._children = {}
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self._children = {}
        super().clear()  # type: ignore[misc]


class Counter(_CachedLabels, prometheus_client.Counter):
    pass


class Gauge(_CachedLabels, prometheus_client.Gauge):
    pass


class Histogram(_CachedLabels, prometheus_client.Histogram):
    pass


_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

BATCH_REQUESTS = Histogram("shoal_batch_requests", "requests per batch", ["model"],
                           buckets=_SIZE_BUCKETS)
BATCH_ITEMS = Histogram("shoal_batch_items", "items per batch", ["model"], buckets=_SIZE_BUCKETS)
BATCH_TOKENS = Histogram("shoal_batch_tokens", "estimated padded tokens per batch", ["model"],
                         buckets=_TOKEN_BUCKETS)
BATCH_FILL = Histogram("shoal_batch_fill_ratio", "batch tokens / token budget", ["model"],
                       buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
BATCH_SECONDS = Histogram("shoal_batch_seconds", "wall time of a batch in the runtime",
                          ["model"], buckets=_SECONDS)
# Busy time of the device in the batches' forward passes (CUDA events on a GPU, the
# forward's wall time on CPU): rate() of it is the fraction of time the device works.
DEVICE_BUSY = Counter("shoal_device_busy_seconds_total",
                      "device time spent in forward passes", ["model"])
QUEUE_WAIT = Histogram("shoal_queue_wait_seconds", "from publish to batch start", ["model"],
                       buckets=_SECONDS)
SPLIT = Counter("shoal_split_requests_total",
                "requests too big for one batch, run as several parts", ["model"])
RETURNS = Counter("shoal_returned_total", "messages given back to the queue", ["model"])
EXPIRED = Counter("shoal_expired_total", "messages whose deadline passed before running",
                  ["model"])
DEAD_LETTERED = Counter("shoal_dead_lettered_total", "dead-lettered messages answered",
                        ["model", "reason"])
RESULTS = Counter("shoal_results_total", "requests answered", ["model", "outcome"])
RUNTIME_RESTARTS = Gauge("shoal_runtime_restarts", "restarts of the model runtime process")
POISON_ISOLATED = Gauge("shoal_poison_isolated", "requests isolated as poison by bisection")
SPARE_PROMOTIONS = Gauge("shoal_runtime_spare_promotions",
                         "runtime restarts that promoted the spare runtime (SHOAL_RUNTIME_SPARE)")
START_FAILURES = Gauge("shoal_runtime_start_failures",
                       "runtime restarts that failed to start and were retried")
HELD = Gauge("shoal_held_messages", "unacked messages held by this worker", ["model"])
PREFETCH = Gauge("shoal_prefetch", "current per-consumer prefetch", ["model"])

RESIDENT_MODELS = Gauge("shoal_resident_models", "models (and LoRA adapters) loaded")
RESIDENT_BYTES = Gauge("shoal_resident_bytes", "device bytes the loaded models take")
BUDGET_BYTES = Gauge("shoal_device_budget_bytes", "device bytes the models may take")
LOADS = Counter("shoal_model_loads_total", "model loads", ["model", "outcome"])
LOAD_SECONDS = Histogram("shoal_model_load_seconds", "time to load a model", ["model"],
                         buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
EVICTIONS = Counter("shoal_model_evictions_total", "models evicted to make room, by what "
                    "chose them: value (the fleet's plan: cheapest absence first) or lru",
                    ["model", "reason"])
DEMAND = Gauge("shoal_model_demand_rps", "requests per second the fleet receives for a "
               "model (every worker's report summed, as this worker sees it)", ["model"])
DEMAND_BUSY = Gauge("shoal_model_demand_busy", "device seconds per second the fleet's "
                    "batches of a model take", ["model"])
COPIES = Gauge("shoal_model_copies", "workers the fleet's plan has keep a model loaded "
               "(0: swapped in on demand by one worker)", ["model"])
STANDBY = Gauge("shoal_model_standby", "1 while this worker leaves a model's queue to the "
                "workers the fleet's plan has serve it (it does not consume it), else 0",
                ["model"])
LOAD_WAIT = Histogram("shoal_model_load_wait_seconds", "how long requests waited for their "
                      "model to load", ["model"], buckets=_SECONDS)

STREAM_DELTAS = Counter("shoal_stream_deltas_total", "streamed output chunks published",
                        ["model"])
TIME_TO_FIRST_TOKEN = Histogram("shoal_time_to_first_token_seconds", "generate: from a "
                                "request's start in the runtime to its first token",
                                ["model"], buckets=_SECONDS)
INTER_TOKEN = Histogram("shoal_inter_token_seconds", "generate: mean time between a "
                        "completion's tokens", ["model"], buckets=_SECONDS)
CANCELLED = Counter("shoal_generations_cancelled_total", "generations stopped before their "
                    "end because their caller left or revoked them", ["model"])
REVOKED = Counter("shoal_revoked_total", "requests revoked (their caller hung up, or a "
                  "Celery client revoked them), by where the revoke found them: held "
                  "(answered CANCELLED at once, never run), arrived (revoked before its "
                  "delivery: answered CANCELLED on arrival), running (the runtime told: "
                  "dropped before the device if still queued there, a generation stopped)",
                  ["model", "where"])
IN_FLIGHT = Gauge("shoal_runtime_in_flight", "requests handed to a continuously batching "
                  "runtime (SGLang) and not yet answered", ["model"])

DRAINING = Gauge("shoal_worker_draining", "1 while the worker drains for a shutdown (it "
                 "consumes nothing and finishes what runs), else 0")
HANDED_BACK = Counter("shoal_shutdown_handed_back_total", "requests that had not started, "
                      "handed back to their queue when the worker began to drain", ["model"])
DRAIN_ANSWERED = Counter("shoal_shutdown_answered_total", "requests answered while the "
                         "worker drained (what ran when the signal came)", ["model"])
SHUTDOWNS_FORCED = Counter("shoal_shutdown_forced_total", "drains cut short (a second "
                           "signal, or SHOAL_SHUTDOWN_GRACE_S ran out): what ran is redelivered")

CLAIMS_FETCHED = Counter("shoal_claims_fetched_total", "claim-checked inputs fetched from the "
                         "blob store: ok, or the error that failed their request", ["outcome"])
CLAIM_BYTES = Counter("shoal_claim_bytes_total", "bytes of claim-checked inputs fetched")
CLAIM_FETCH_SECONDS = Histogram("shoal_claim_fetch_seconds", "from a claim-checked request's "
                                "delivery to its inputs fetched and checked", buckets=_SECONDS)
CLAIMS_DELETED = Counter("shoal_claims_deleted_total", "claimed blobs deleted once their "
                         "message was acked")

