"""Dense vectors as results: Matryoshka truncation, normalisation, output dtypes."""

from __future__ import annotations

from typing import Any

import numpy as np

from tasks.options import EncodeOptions
from tasks.schema import ParsedRequest


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def quantize(rows: np.ndarray, dtype: str) -> bytes:
    """Row-major bytes of `rows` in `dtype` (see tasks.results for reading them back).

    int8 scales each row so its largest |component| is 127: the direction (what
    cosine similarity compares) is kept, the length is not. binary is one bit per
    component (1 where > 0), packed 8 to a byte, first component in the high bit,
    the layout of Hamming-distance indexes (faiss, usearch).
    """
    if dtype == "float32":
        return np.ascontiguousarray(rows, dtype="<f4").tobytes()
    if dtype == "float16":
        return np.ascontiguousarray(rows, dtype="<f2").tobytes()
    if dtype == "int8":
        scale = 127.0 / np.maximum(np.abs(rows).max(axis=1, keepdims=True), 1e-12)
        return np.clip(np.rint(rows * scale), -127, 127).astype(np.int8).tobytes()
    if dtype == "binary":
        return np.packbits(rows > 0, axis=1).tobytes()
    raise ValueError(f"unknown dtype {dtype!r}")


def dense_result(rows: np.ndarray, options: EncodeOptions, normalize_default: bool,
                 tokens: int) -> dict[str, Any]:
    """An encode result for pooled float vectors (one row per item)."""
    if options.dimensions is not None:
        rows = rows[:, : options.dimensions]
    if normalize_default if options.normalize is None else options.normalize:
        rows = normalize_rows(rows)
    return {
        "output": "dense",
        "dims": int(rows.shape[1]),
        "count": int(rows.shape[0]),
        "dtype": options.dtype,
        "embeddings": quantize(rows, options.dtype),
        "usage": {"tokens": tokens},
    }


def dense_results(prepared: list[ParsedRequest], vectors: np.ndarray,
                  input_ids: list[list[int]], normalize_default: bool) -> list[dict[str, Any]]:
    """Each request's `dense_result` from a batch's pooled vectors (its texts' rows, in
    order) and the token ids they were computed from."""
    results, offset = [], 0
    for parsed in prepared:
        n = len(parsed.items)
        used = sum(len(ids) for ids in input_ids[offset : offset + n])
        results.append(dense_result(vectors[offset : offset + n], parsed.options,
                                    normalize_default, used))
        offset += n
    return results
