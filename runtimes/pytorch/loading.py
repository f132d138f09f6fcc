"""Loading a model directory: what every adapter's `__init__` starts with."""

from __future__ import annotations

from typing import Any, NamedTuple

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


class LoadedModel(NamedTuple):
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel
    pad_id: int  # what sequences are padded with


def load_model(model_class: Any, ref: str, device: str) -> LoadedModel:
    """The tokenizer and the model (`model_class.from_pretrained`, in eval mode on `device`)
    of the local directory `ref`.

    Every source is a local directory by now (hub models are snapshots too), so nothing is
    fetched here: `local_files_only` keeps a missing file an error instead of a download.
    """
    tokenizer = AutoTokenizer.from_pretrained(ref, local_files_only=True)
    model = model_class.from_pretrained(ref, local_files_only=True)
    model.eval().to(device)
    return LoadedModel(tokenizer, model, pad_id(tokenizer))


def pad_id(tokenizer: PreTrainedTokenizerBase, *fallbacks: int) -> int:
    """The tokenizer's pad token, else the first of `fallbacks`, else 0 (the attention mask
    hides padding, so any id does when the tokenizer names none)."""
    return next((i for i in (tokenizer.pad_token_id, *fallbacks) if i is not None), 0)
