"""Cohere's embedding types from one request's float32 vectors (`gateway.routes.cohere_embed`).

The model runs once, in float32; each type asked for is made from those rows here, with
the workers' own quantiser (`tasks.quantize`), so an int8 or binary vector is the bytes
`options.dtype` int8 or binary gives on /v1/encode:

- `float`: the rows; `base64`: each row's little-endian float32 bytes in base64 (Cohere's
  "float embedding bytes appended together");
- `int8`: each row scaled so its largest |component| is 127, rounded (-127..127: Cohere's
  range is -128..127); `uint8`: those values + 128 (1..255);
- `ubinary`: one bit per component, 1 where it is > 0, packed 8 to a byte with the first
  component in the high bit (0..255, dims/8 values: Cohere's packed unsigned binary);
  `binary`: those bytes - 128 (-128..127), as Cohere's and sentence-transformers' signed
  binary.

Cohere calibrates its int8 ranges on its own data, which shoal does not have: the scaling
per row keeps each vector's direction (what cosine similarity compares), not its length.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")


def typed_embeddings(rows: np.ndarray, types: list[str]) -> dict[str, Any]:
    """`{type: vectors}` for each of `types` (EMBEDDING_TYPES), from float32 `rows`: numpy
    arrays (`encode_response` writes them), base64 as strings."""
    import numpy as np

    from tasks.quantize import quantize

    count = rows.shape[0]
    out: dict[str, Any] = {}
    for kind in types:
        if kind == "float":
            out[kind] = rows
        elif kind == "base64":
            out[kind] = [base64.b64encode(row.astype("<f4").tobytes()).decode()
                         for row in rows]
        elif kind in ("int8", "uint8"):
            signed = np.frombuffer(quantize(rows, "int8"), np.int8).reshape(count, -1)
            out[kind] = signed if kind == "int8" else (signed.astype(np.int16) + 128
                                                       ).astype(np.uint8)
        elif kind in ("binary", "ubinary"):
            packed = np.frombuffer(quantize(rows, "binary"), np.uint8).reshape(count, -1)
            out[kind] = packed if kind == "ubinary" else (packed.astype(np.int16) - 128
                                                          ).astype(np.int8)
        else:
            raise ValueError(f"unknown embedding type {kind!r}")
    return out
