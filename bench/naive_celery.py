"""Baseline: the naive Celery deployment of the same model, one task per request.

This is what one writes first: a Celery task that runs the model on the
request it was given, a prefork worker, `worker_prefetch_multiplier=1`,
acks after the task, msgpack. It consumes the same model queue as shoal's
worker (same arguments), so the same gateway and the same load can front
either; what differs is only the worker: no batching across requests.
It is not a straw man: same model code (`DenseEncoder`, sorted, padded to the
longest), the same result format, one task at a time using every torch thread.

    SHOAL_QUEUE_PREFIX=... SHOAL_MODELS=sentence-transformers/all-MiniLM-L6-v2 \\
        celery -A bench.naive_celery worker --pool prefork --concurrency 1
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_process_init

from tasks.catalog import load_catalog
from tasks.queues import model_kombu_queue
from tasks.settings import get_settings

settings = get_settings()
app = Celery("naive", broker=settings.broker_url, backend="rpc://")
app.conf.update(
    task_serializer="msgpack",
    result_serializer="msgpack",
    accept_content=["msgpack", "json"],
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    task_queues=[model_kombu_queue(m, settings) for m in settings.models],
    worker_hijack_root_logger=False,
)
_encoders: dict[str, Any] = {}


@worker_process_init.connect
def _load_models(**_: Any) -> None:
    """Each prefork child loads the models itself (after the fork, as CUDA would need)."""
    from runtimes.pytorch.dense import DenseEncoder
    from tasks.sources import resolve_source

    for entry in load_catalog(settings.catalog_dir).require(settings.models):
        _encoders[entry.id] = DenseEncoder(resolve_source(entry.source),
                                           pooling=entry.pooling, normalize=entry.normalize,
                                           max_seq_length=entry.max_seq_length)


@app.task(name="shoal.encode")
def encode(model: str, items: list[dict[str, Any]], options: dict | None = None) -> dict:
    import time

    import numpy as np

    started = time.perf_counter()
    vectors = np.ascontiguousarray(_encoders[model].encode([i["text"] for i in items]), "<f4")
    return {
        "model": model, "output": "dense", "dims": int(vectors.shape[1]),
        "count": len(items), "dtype": "float32", "embeddings": vectors.tobytes(),
        "usage": {"tokens": 0},
        "batch": {"requests": 1, "items": len(items),
                  "inference_ms": (time.perf_counter() - started) * 1000},
    }
