"""Celery signatures for backend services: `encode.delay(model=..., items=[...])`.

    from tasks.client import encode
    result = encode.delay(model="sentence-transformers/all-MiniLM-L6-v2",
                          items=[{"text": "hello"}]).get(timeout=10)
    vectors = embedding_rows(result)

The task is routed to the model's queue and served by a shoal worker; the
result is the same dict an HTTP caller's response is made from.
"""

from __future__ import annotations

from app.celery import app
from tasks import errors  # noqa: F401  (lets AsyncResult.get() re-raise ShoalError)
from tasks.names import CLASSIFY, ENCODE, EXTRACT, GENERATE, SCORE
from tasks.results import embedding_rows, multivector_rows, ranked

encode = app.signature(ENCODE)
score = app.signature(SCORE)
extract = app.signature(EXTRACT)
classify = app.signature(CLASSIFY)
generate = app.signature(GENERATE)

__all__ = ["app", "classify", "embedding_rows", "encode", "extract", "generate",
           "multivector_rows", "ranked", "score"]
