"""Where a model's ONNX graph is: shipped in its folder, or exported into the cache.

A model folder that ships `onnx/model.onnx` (the layout of Hugging Face's ONNX exports;
`model_int8.onnx` / `model_quantized.onnx` and `model_fp16.onnx` for the other
precisions) is used as is. Otherwise `shoal export` writes the graph into the cache,
`$SHOAL_ONNX_CACHE` (default `~/.cache/shoal/onnx`), under a folder named by a hash
of the weights and config and by the head the family needs, so a changed checkpoint
never meets a stale graph and two workers sharing the cache share the export.

Torch-free: the runtime reads paths here, `runtimes.onnx.export` writes them.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

# What each family's graph computes: the model class it is exported from.
HEADS = {
    "dense": "base",
    "sparse": "masked-lm",
    "cross-encoder": "sequence-classification",
    "sequence-classification": "sequence-classification",
    "zero-shot": "sequence-classification",
    "token-classification": "token-classification",
}
SHIPPED = {
    "fp32": ("model.onnx",),
    "int8": ("model_int8.onnx", "model_quantized.onnx"),
    "fp16": ("model_fp16.onnx",),
}
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "config.json")


class GraphMissing(LookupError):
    """No graph of this model at this precision, shipped or exported."""


def cache_root() -> Path:
    return Path(os.environ.get("SHOAL_ONNX_CACHE") or Path.home() / ".cache/shoal/onnx")


def hash_weights(folder: Path) -> str:
    """A short hash of the files from_pretrained reads the model from (read now; see
    `weights_digest` for the cached one)."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in _WEIGHTS for p in folder.glob(pattern)})
    if not files:
        raise ValueError(f"{folder} has no weights (safetensors or pytorch_model.bin) to "
                         "export and no onnx/model.onnx")
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()[:16]


# A serving process hashes a model's weights once (they do not change under it).
weights_digest = cache(hash_weights)


def shipped_graph(folder: Path, precision: str) -> Path | None:
    for name in SHIPPED[precision]:
        path = folder / "onnx" / name
        if path.is_file():
            return path
    return None


# The file an export writes per precision; renamed when its recipe changes, so a cache
# never serves a graph made the old way (int8-r7: 7-bit weights, issue 41).
CACHED_NAMES = {"fp32": "fp32.onnx", "int8": "int8-r7.onnx", "fp16": "fp16.onnx"}


def cached_graph(folder: Path, head: str, precision: str) -> Path:
    """Where `shoal export` puts (and the runtime looks for) the graph."""
    return cache_root() / f"{weights_digest(folder)}-{head}" / CACHED_NAMES[precision]


def graph_of(folder: Path, family: str, precision: str) -> Path:
    """The graph to serve: the shipped one, else the exported one (which may not exist)."""
    return shipped_graph(folder, precision) or cached_graph(folder, HEADS[family], precision)
