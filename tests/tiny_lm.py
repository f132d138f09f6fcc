"""Tiny randomly initialised causal LMs of real architectures, saved like a user's model.

No Llama or GPT-2 tokenizer is available offline, so both borrow the MiniLM
(BERT) tokenizer and size their vocabulary to it; [SEP] plays the end of text
token and [PAD] the padding token. The Llama-style model also gets [CLS] as its
BOS token and a chat template, so it exercises BOS handling and chat prompts;
the GPT-2 has neither, like the real GPT-2.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

from tests.tiny_models import MINILM_DIR

# Jinja that a BERT tokenizer splits cleanly: "<user> hi <assistant> ".
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
CONTEXT = 256


def tiny_tokenizer(bos: bool, chat_template: bool) -> PreTrainedTokenizerBase:
    extra = {"bos_token": "[CLS]"} if bos else {}
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR), eos_token="[SEP]",
                                              pad_token="[PAD]", **extra)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_llama(out: Path, seed: int = 0, chat_template: bool = True,
                     hidden_size: int = 32) -> Path:
    """`hidden_size` 64 gives head_dim 16, the smallest SGLang's CPU attention takes."""
    tokenizer = tiny_tokenizer(bos=True, chat_template=chat_template)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden_size,
        max_position_embeddings=CONTEXT, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_gpt2(out: Path, seed: int = 0, chat_template: bool = False) -> Path:
    tokenizer = tiny_tokenizer(bos=False, chat_template=chat_template)
    config = GPT2Config(
        vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=CONTEXT,
        # GPT-2 starts and ends texts with the same token.
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
