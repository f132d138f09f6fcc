"""The kwargs schema of each task, checked wherever a request enters.

The gateway checks a request before publishing it; Celery clients publish
straight to the queue, so the runtime checks again with the same function and
answers a bad request with a VALIDATION_ERROR instead of failing the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.errors import ErrorCode, ShoalError

ENCODE_OPTIONS = {"normalize", "dimensions", "truncate"}


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    texts: list[str]
    normalize: bool | None
    dimensions: int | None
    truncate: bool


def _invalid(message: str) -> ShoalError:
    return ShoalError(ErrorCode.VALIDATION_ERROR, message)


def parse_encode(kwargs: dict[str, Any], dims: int) -> EncodeRequest:
    items = kwargs.get("items")
    if not isinstance(items, list) or not items:
        raise _invalid("'items' must be a non-empty list of {'text': str}")
    texts: list[str] = []
    for i, item in enumerate(items):
        text = item.get("text") if isinstance(item, dict) else None
        if not isinstance(text, str):
            raise _invalid(f"items[{i}] must be an object with a string 'text'")
        texts.append(text)
    options = kwargs.get("options") or {}
    if not isinstance(options, dict):
        raise _invalid("'options' must be an object")
    unknown = set(options) - ENCODE_OPTIONS
    if unknown:
        raise _invalid(f"unknown options {sorted(unknown)}; allowed: {sorted(ENCODE_OPTIONS)}")
    normalize = options.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise _invalid("options.normalize must be true or false")
    truncate = options.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _invalid("options.truncate must be true or false")
    dimensions = options.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int)
        or not 1 <= dimensions <= dims
    ):
        raise _invalid(f"options.dimensions must be an integer from 1 to {dims}")
    return EncodeRequest(texts, normalize, dimensions, truncate)
