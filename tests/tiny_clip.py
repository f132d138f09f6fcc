"""Tiny randomly initialised CLIP and SigLIP models, saved the way a user's model is.

The real CLIP BPE and SigLIP sentencepiece tokenizers need a download, so the
text towers borrow the MiniLM BERT tokenizer (see tests.tiny_models): the
vocabulary size matches it and the special token ids in the text config are
BERT's, so CLIP's text pooling (the first position holding `eos_token_id`)
lands on [SEP], which the tokenizer puts at the end of every text, truncated or
not. Each directory loads back through AutoModel, AutoTokenizer and
AutoImageProcessor like a model from the hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    CLIPConfig,
    CLIPModel,
    PreTrainedTokenizerBase,
    SiglipConfig,
    SiglipModel,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from tests.tiny_models import MINILM_DIR

HIDDEN = 32
IMAGE_SIZE = 32
PROJECTION_DIM = 16  # CLIP
SIGLIP_DIMS = HIDDEN
CLIP_MAX_TOKENS = 32
SIGLIP_MAX_TOKENS = 64  # SigLIP pads every text to this length, as it was trained


def _tokenizer(max_tokens: int) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    tokenizer.model_max_length = max_tokens
    return tokenizer


def _tower(**extra: Any) -> dict[str, Any]:
    return {"hidden_size": HIDDEN, "intermediate_size": 37, "num_hidden_layers": 2,
            "num_attention_heads": 2, **extra}


def _text_tower(tokenizer: PreTrainedTokenizerBase, max_tokens: int,
                **extra: Any) -> dict[str, Any]:
    return _tower(
        vocab_size=len(tokenizer), max_position_embeddings=max_tokens,
        eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id, **extra,
    )


def build_tiny_clip(out: Path, seed: int = 0) -> Path:
    """A CLIPModel with a 16-wide projection, 32-pixel images, texts up to 32 tokens."""
    tokenizer = _tokenizer(CLIP_MAX_TOKENS)
    config = CLIPConfig(
        text_config=_text_tower(tokenizer, CLIP_MAX_TOKENS),
        vision_config=_tower(image_size=IMAGE_SIZE, patch_size=8),
        projection_dim=PROJECTION_DIM,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    ).save_pretrained(out)
    return out


def build_tiny_siglip(out: Path, seed: int = 0) -> Path:
    """A SiglipModel with 32-wide vectors (SigLIP has no projection: its vectors are as
    wide as the vision tower, and the text head maps to that), texts padded to 64 tokens."""
    tokenizer = _tokenizer(SIGLIP_MAX_TOKENS)
    config = SiglipConfig(
        text_config=_text_tower(tokenizer, SIGLIP_MAX_TOKENS, projection_size=HIDDEN),
        vision_config=_tower(image_size=IMAGE_SIZE, patch_size=8),
    )
    torch.manual_seed(seed)
    SiglipModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
    return out
