"""A causal LM's prompt tokens, built the same way by every runtime that serves one.

Torch-free: the PyTorch causal-lm adapter (`runtimes.pytorch.causal_lm`) and the SGLang
runtime (`runtimes.sglang`, which tokenizes in the worker and sends SGLang token ids) both
build prompts here, so a prompt is the same token ids whichever runtime serves the model.

The rules: a text prompt gets the tokenizer's BOS token when the tokenizer itself adds one
(Llama, Mistral, Gemma) and nothing otherwise (GPT-2, Qwen); end tokens a tokenizer appends
(BERT's [SEP]) are never added, as they would tell the model the text is over. Chat messages
are rendered by the tokenizer's chat template (`add_generation_prompt=True`), which writes its
own special tokens, and the rendered text is tokenized without adding any. A token-id
item (`{"tokens": [...]}`) is the prompt exactly as given, nothing added (a BOS the model
wants is the caller's to put first, as `tokenizer(text)["input_ids"]` does), once its ids
are checked against the tokenizer's vocabulary.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from runtimes.families.token_ids import check_ids
from tasks.errors import ErrorCode, ShoalError
from tasks.schema import Item, invalid


def bos_id(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer puts one before a text by itself, else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if with_special[:1] == [bos] and plain[:1] != [bos] else None


def prompt_ids(tokenizer: Any, bos: int | None, item: Item, index: int,
               model_id: str) -> list[int]:
    """The token ids of one item's prompt (`bos`: what `bos_id` found for the tokenizer)."""
    if item.tokens is not None:
        # len(tokenizer): its ids, added tokens included; a model's embedding has at least
        # as many rows (often more, padded for speed, which no id of its own reaches).
        check_ids(item.tokens, index, len(tokenizer), model_id)
        return list(item.tokens)
    if item.messages is None:
        ids = tokenizer(item.text or "", add_special_tokens=False)["input_ids"]
        return ids if bos is None else [bos, *ids]
    if not tokenizer.chat_template:
        raise invalid(f"{model_id} has no chat template; send a plain prompt to "
                      "/v1/completions instead")
    messages = [{"role": role, "content": content} for role, content in item.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    except TemplateError as exc:
        raise invalid(f"items[{index}].messages: {model_id}'s chat template refused "
                      f"them: {exc}") from None
    # The template wrote the special tokens it wants; adding them again doubles BOS.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def too_long(index: int, prompt: int, max_tokens: int, context: int) -> ShoalError:
    return ShoalError(
        ErrorCode.INPUT_TOO_LONG,
        f"items[{index}] has {prompt} prompt tokens and options.max_tokens is {max_tokens}: "
        f"{prompt + max_tokens} tokens, over the model's context of {context}; shorten the "
        "prompt or lower options.max_tokens",
    )


def check_prompt(ids: list[int], index: int, max_tokens: int, context: int) -> None:
    """VALIDATION_ERROR for an empty prompt, INPUT_TOO_LONG for one whose completion
    would not fit the context."""
    if not ids:
        raise invalid(f"items[{index}] is empty; send a prompt of at least one token")
    if len(ids) + max_tokens > context:
        raise too_long(index, len(ids), max_tokens, context)
