"""What a SPLADE model's files say about its pooling, and the pooling itself on numpy
arrays; the PyTorch and ONNX sparse adapters share both."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from runtimes.files import model_file

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
