"""What a SPLADE model's files say about its pooling, and the pooling itself on numpy
arrays: the sparse family's (`runtimes.families.sparse`) and an engine's that pools on
the host."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtimes.families.text import check_lengths
from runtimes.model_files.files import model_file
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest

# Each forward pass holds (tokens x vocabulary) float logits; this caps them at
# 512 MiB whatever the batch's token budget (30k-term vocabularies: ~4k tokens).
LOGITS_BUDGET = 1 << 27

_POOLINGS = ("max", "sum")
_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class SpladeConfig:
    """What a sentence-transformers SparseEncoder save says; the defaults are SPLADE v2+."""

    pooling: str = "max"
    activation: str = "relu"
    encoder_dir: str = ""  # the MLM transformer's folder inside the model


def read_splade_config(ref: str) -> SpladeConfig:
    modules_file = model_file(ref, "modules.json")
    if modules_file is None:
        return SpladeConfig()
    config = SpladeConfig()
    for module in json.loads(modules_file.read_text()):
        kind = module.get("type", "")
        path = module.get("path", "")
        if kind.endswith(".SpladePooling"):
            pooling_file = model_file(ref, f"{path}/config.json")
            raw = json.loads(pooling_file.read_text()) if pooling_file else {}
            config = SpladeConfig(raw.get("pooling_strategy", "max"),
                                  raw.get("activation_function", "relu"), config.encoder_dir)
        elif kind.endswith("Transformer"):  # Transformer (v6) or MLMTransformer (v5)
            config = SpladeConfig(config.pooling, config.activation, path)
        else:
            # Inference-free (static query) and auto-encoder sparse models compute
            # something else; serving them as SPLADE would be silently wrong.
            raise ValueError(f"{ref}: sparse module {kind!r} is not supported; the sparse "
                             "adapter serves an MLM transformer with SPLADE pooling")
    if config.pooling not in _POOLINGS or config.activation not in _ACTIVATIONS:
        raise ValueError(f"{ref}: SPLADE pooling {config.pooling!r} with activation "
                         f"{config.activation!r} is not supported; supported: pooling "
                         f"{list(_POOLINGS)}, activation {list(_ACTIVATIONS)}")
    return config


def splade_weights(logits: np.ndarray, mask: np.ndarray,
                   config: SpladeConfig) -> np.ndarray:
    """(texts, vocabulary) term weights of (texts, tokens, vocabulary) logits: log(1 +
    relu(logit)) (twice for `log1p_relu`), max or sum over the mask's tokens."""
    weights = np.log1p(np.maximum(logits.astype(np.float32, copy=False), 0))
    if config.activation == "log1p_relu":
        np.log1p(weights, out=weights)
    # Weights are >= 0, so zeroing the padding keeps it out of a max as well as a sum.
    weights *= mask[:, :, None].astype(np.float32)
    return weights.max(axis=1) if config.pooling == "max" else weights.sum(axis=1)


def nonzero_terms(row: np.ndarray) -> dict[str, list]:
    """`{"indices", "values"}` of a row's non-zero terms, ascending."""
    indices = np.flatnonzero(row)
    return {"indices": indices.tolist(), "values": row[indices].tolist()}


def check_vocabulary(entry: ModelEntry, vocab_size: int) -> None:
    """A sparse entry's `dims`, if given, must be the vocabulary's size."""
    if entry.dims is not None and entry.dims != vocab_size:
        raise ValueError(f"{entry.id}: its sparse vectors span the {vocab_size}-term "
                         f"vocabulary, but the catalog entry says dims: {entry.dims}; set dims "
                         f"to {vocab_size} or leave it out")


def check_sparse_request(parsed: ParsedRequest, entry: ModelEntry, tokenizer: Any,
                         texts: list[str], limit: int) -> None:
    """A sparse request's `texts` (prompted) within `limit` tokens unless it asks for
    truncation. Its output options are the entry's to check (`ModelEntry.parse`: the
    adapter's `prepare` made it, with the same dims)."""
    if not parsed.options.truncate:
        ids = tokenizer(texts, truncation=False, padding=False)["input_ids"]
        check_lengths([len(row) for row in ids], limit)


def sparse_results(prepared: list[ParsedRequest], vectors: list[dict[str, list]],
                   input_ids: list[list[int]], vocab_size: int) -> list[dict[str, Any]]:
    """Each request's result from a batch's vectors (its texts', in order) and the token
    ids they were computed from."""
    results, offset = [], 0
    for parsed in prepared:
        n = len(parsed.items)
        results.append({
            "output": "sparse",
            "count": n,
            "vocab_size": vocab_size,
            "embeddings": vectors[offset : offset + n],
            "usage": {"tokens": sum(len(ids) for ids in input_ids[offset : offset + n])},
        })
        offset += n
    return results
