"""Tiny randomly initialised sparse (SPLADE) and multi-vector (ColBERT) encoders.

Like `tests.tiny_models`, they borrow the MiniLM tokenizer so nothing is
downloaded, and are saved with `save_pretrained` in the layouts real
checkpoints use, so the adapters load them exactly as they load a user's
model: a plain masked-LM directory for SPLADE; for ColBERT either a
sentence-transformers / PyLate directory (a `1_Dense` projection module
listed in `modules.json`) or the Stanford `colbert-ir/colbertv2.0` layout (a
`linear.weight` tensor next to the `bert.*` weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel, BertPreTrainedModel

from tests.tiny_models import MINILM_DIR

HIDDEN = 32


def tiny_config(vocab_size: int, hidden: int = HIDDEN) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=128,
    )


def build_tiny_splade(out: Path, seed: int = 0, logit_bias: float = -0.3) -> Path:
    """A random BertForMaskedLM. Random MLM logits are positive about half the time; the
    negative output bias makes most of them negative, so the SPLADE vectors are sparse (a
    few hundred terms, not half the vocabulary) like a trained model's."""
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    torch.manual_seed(seed)
    model = BertForMaskedLM(tiny_config(tokenizer.vocab_size))
    with torch.no_grad():
        model.cls.predictions.bias.fill_(logit_bias)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def projection_weight(dims: int, seed: int = 0, hidden: int = HIDDEN) -> torch.Tensor:
    """The (dims, hidden) ColBERT projection the builders below save for `seed`."""
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(dims, hidden, generator=generator) * 0.2


def _tiny_bert(seed: int) -> tuple[BertModel, object]:
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    torch.manual_seed(seed)
    return BertModel(tiny_config(tokenizer.vocab_size)), tokenizer


def build_tiny_colbert_st(out: Path, dims: int = 16, seed: int = 0,
                          dense_dir: str = "1_Dense") -> Path:
    """The sentence-transformers / PyLate layout: the encoder at the root, the projection in
    a Dense module folder (config.json + model.safetensors holding `linear.weight`)."""
    bert, tokenizer = _tiny_bert(seed)
    bert.save_pretrained(out)
    tokenizer.save_pretrained(out)
    modules = [
        {"idx": 0, "name": "0", "path": "",
         "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": dense_dir,
         "type": "sentence_transformers.base.modules.dense.Dense"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.base.modules.normalize.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / dense_dir).mkdir()
    (out / dense_dir / "config.json").write_text(json.dumps({
        "in_features": HIDDEN, "out_features": dims, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }))
    save_file({"linear.weight": projection_weight(dims, seed).contiguous()},
              str(out / dense_dir / "model.safetensors"))
    (out / "2_Normalize").mkdir()
    return out


class HF_ColBERT(BertPreTrainedModel):  # the class name Stanford checkpoints record
    """The Stanford ColBERT checkpoint class: BERT plus a bias-free projection."""

    config_class = BertConfig
    base_model_prefix = "bert"

    def __init__(self, config: BertConfig, dims: int = 128) -> None:
        super().__init__(config)
        self.bert = BertModel(config)
        self.linear = nn.Linear(config.hidden_size, dims, bias=False)
        self.post_init()


def build_tiny_colbert_stanford(out: Path, dims: int = 16, seed: int = 0) -> Path:
    """The colbert-ir/colbertv2.0 layout, with the same weights `build_tiny_colbert_st`
    saves for the same seed: one model.safetensors holding `bert.*` and `linear.weight`."""
    bert, tokenizer = _tiny_bert(seed)
    model = HF_ColBERT(bert.config, dims)
    with torch.no_grad():
        model.bert.load_state_dict(bert.state_dict())
        model.linear.weight.copy_(projection_weight(dims, seed))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
