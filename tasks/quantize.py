"""Float vectors as the smaller dtypes: the one quantiser the workers (`tasks.options`'
dtype, `runtimes.families.vectors`) and the gateway (Cohere's embedding types,
`gateway.routes.cohere_embed`) share, so an int8 or binary vector is the same bytes
whichever side made it. numpy is imported by whoever calls it: the gateway only with
its first Cohere request (`gateway.calls.vectors` says why)."""

from __future__ import annotations

import numpy as np


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
