"""A request too big for one batch, run as budget-sized parts, and its parts' results
put back together in order.

A worker splits a request whose items would not fit one batch of its model
(more items than the batch's item cap, or more tokens than its budget), or
would take longer than a part may (`batching.parts`), so that it runs as
several batches the scheduler interleaves with other work instead of one long
batch every other caller waits behind. The caller sees
one request and one result, the same as if it had run whole: the items of
every operation except `generate` are computed independently of each other,
so a part's result is exactly that slice of the whole result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Operations whose items are independent (generate keeps its prompts together: n,
# seeds and stop strings belong to the request).
SPLITTABLE = frozenset({"encode", "score", "extract", "classify"})
_SUMMED = frozenset({"count"})


def split_kwargs(kwargs: Mapping[str, Any], per_part: int) -> list[dict[str, Any]]:
    """The request's kwargs as consecutive parts of at most `per_part` items each."""
    items = list(kwargs.get("items") or [])
    return [{**kwargs, "items": items[i:i + per_part]} for i in range(0, len(items), per_part)]


def merge_results(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One result from its parts' results, in order.

    Per-item data are joined (raw vector bytes concatenated, per-item lists
    extended), counts and usage added, and everything else (output kind, dims,
    dtype, model) taken from the first part, where every part agrees.
    """
    merged: dict[str, Any] = dict(results[0])
    for result in results[1:]:
        for key, value in result.items():
            merged[key] = _joined(key, merged.get(key), value)
    return merged


def _joined(key: str, first: Any, value: Any) -> Any:
    if isinstance(value, bytes | bytearray) and isinstance(first, bytes | bytearray):
        return bytes(first) + bytes(value)
    if isinstance(value, list) and isinstance(first, list):
        return first + value
    if key in _SUMMED and isinstance(value, int) and isinstance(first, int):
        return first + value
    if key == "usage" and isinstance(value, Mapping) and isinstance(first, Mapping):
        return {k: first.get(k, 0) + value.get(k, 0) for k in {*first, *value}}
    return value if first is None else first
