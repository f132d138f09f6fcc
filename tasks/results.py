"""Read results: an encode result carries its vectors as raw little-endian float32."""

from __future__ import annotations

import sys
from array import array
from typing import Any


def embedding_rows(result: dict[str, Any]) -> list[list[float]]:
    """The vectors of an encode result as lists of floats."""
    return [row.tolist() for row in embedding_arrays(result)]


def embedding_arrays(result: dict[str, Any]) -> list[array]:
    """The vectors of an encode result as `array('f')` rows (no numpy needed)."""
    flat = array("f")
    flat.frombytes(result["embeddings"])
    if sys.byteorder == "big":
        flat.byteswap()
    dims = result["dims"]
    return [flat[i * dims : (i + 1) * dims] for i in range(result["count"])]
