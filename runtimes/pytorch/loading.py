"""Loading a model directory: what every adapter's `__init__` starts with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from runtimes.families.text import max_length
from runtimes.pytorch import buckets, device_seam
from runtimes.pytorch.device_time import watch_forward


class LoadedModel(NamedTuple):
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel
    pad_id: int  # what sequences are padded with


def load_model(model_class: Any, ref: str, device: str, dtype: torch.dtype | None = None,
               bucket_tokens: int | Callable[[Any], int] | None = None,
               bucket_width: int | None = None) -> LoadedModel:
    """The tokenizer and the model (`model_class.from_pretrained`, in eval mode on `device`,
    its weights in `dtype`, float32 when None) of the local directory `ref`, with PyTorch's
    fused attention (SDPA) where the architecture has it.

    Every source is a local directory by now (hub models are snapshots too), so nothing is
    fetched here: `local_files_only` keeps a missing file an error instead of a download.

    A text encoder's family gives `bucket_tokens` (its padded-token budget per pass, or a
    function of the model's config that says it): its passes then go through shape
    buckets (as wide as `bucket_width` where the family knows its limit, else the
    model's) and, on CUDA, graphs captured here, before the device clock watches the
    model (`runtimes.pytorch.buckets`, SHOAL_CUDA_GRAPHS).
    """
    seam = device_seam.configured()  # the real device, unless a benchmark's stand-in
    tokenizer = AutoTokenizer.from_pretrained(ref, local_files_only=True)
    options: dict[str, Any] = {"local_files_only": True, "dtype": dtype or torch.float32}
    try:
        model = model_class.from_pretrained(ref, attn_implementation="sdpa", **options)
    except (ValueError, ImportError):  # an architecture without an SDPA path
        model = model_class.from_pretrained(ref, **options)
    model.eval().to(device)
    if bucket_tokens is not None:
        budget = bucket_tokens(model.config) if callable(bucket_tokens) else bucket_tokens
        inputs = [k for k in buckets.INPUTS
                  if k in ("input_ids", "attention_mask") or k in tokenizer.model_input_names]
        buckets.install(model, field="last_hidden_state" if model_class is AutoModel else "logits",
                        device=device, pad_id=pad_id(tokenizer),
                        limit=max_length(tokenizer, model.config, bucket_width),
                        max_tokens=budget,
                        inputs=inputs, name=ref,
                        replaced_forward=seam.replaces_forward())
    watch_forward(model)
    seam.loaded(model, model_class, ref)
    return LoadedModel(tokenizer, model, pad_id(tokenizer))


def pad_id(tokenizer: PreTrainedTokenizerBase, *fallbacks: int) -> int:
    """The tokenizer's pad token, else the first of `fallbacks`, else 0 (the attention mask
    hides padding, so any id does when the tokenizer names none)."""
    return next((i for i in (tokenizer.pad_token_id, *fallbacks) if i is not None), 0)
