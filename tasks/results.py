"""Read results without numpy: vectors travel as raw little-endian bytes.

A dense encode result is `{"output": "dense", "dims", "count", "dtype",
"embeddings": bytes}` (dtype float32, float16, int8 or binary: one bit per
dimension packed 8 to a byte, high bit first); a multivector result adds
`lengths` (vectors per item) and is always float32; a sparse result holds
`embeddings: [{"indices": [...], "values": [...]}]`.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any

_ARRAY_CODES = {"float32": "f", "int8": "b", "binary": "B"}


def _flat(data: bytes, dtype: str) -> list[float] | list[int] | array:
    if dtype == "float16":
        return list(struct.unpack(f"<{len(data) // 2}e", data))
    flat = array(_ARRAY_CODES[dtype])
    flat.frombytes(data)
    if dtype == "float32" and sys.byteorder == "big":
        flat.byteswap()
    return flat


def row_width(dims: int, dtype: str) -> int:
    """Values per row as stored: bytes for binary, else one per dimension."""
    return (dims + 7) // 8 if dtype == "binary" else dims


def embedding_arrays(result: dict[str, Any]) -> list[Any]:
    """The rows of a dense result (array rows for float32/int8/binary, lists for float16)."""
    flat = _flat(result["embeddings"], result.get("dtype", "float32"))
    width = row_width(result["dims"], result.get("dtype", "float32"))
    return [flat[i * width : (i + 1) * width] for i in range(result["count"])]


def embedding_rows(result: dict[str, Any]) -> list[list[float]] | list[list[int]]:
    """The vectors of a dense result as lists of numbers."""
    return [list(row) for row in embedding_arrays(result)]


def multivector_rows(result: dict[str, Any]) -> list[list[list[float]]]:
    """Per item, its per-token vectors (a multivector result)."""
    flat = _flat(result["embeddings"], "float32")
    dims = result["dims"]
    out, offset = [], 0
    for n in result["lengths"]:
        out.append([list(flat[(offset + j) * dims : (offset + j + 1) * dims]) for j in range(n)])
        offset += n
    return out


def ranked(result: dict[str, Any], top_n: int | None = None) -> list[dict[str, Any]]:
    """A score result's items, best first: `{"index", "score", "rank"}` (rank 1 is best)."""
    order = sorted(range(len(result["scores"])), key=lambda i: -result["scores"][i])
    return [{"index": i, "score": result["scores"][i], "rank": r + 1}
            for r, i in enumerate(order[:top_n] if top_n else order)]
