"""Cheap work estimates made without a tokenizer (the gateway has none).

Sub-word tokenizers give roughly one token per four characters of English;
two more are the special tokens around every sequence. Each operation
counts its own way, in tokens the batch former can add up:

- encode, extract, classify: the item's tokens (an image costs a fixed
  number, `image_tokens`: a ViT-B/32 at 224 px sees 50 patches; a token-id
  item its ids, which already hold the special tokens);
- score: query and document together, one pair per item;
- classify with caller labels (zero-shot): one text-hypothesis pair per label;
- generate: prompt plus the new tokens asked for (decoding dominates).
"""

from __future__ import annotations

from typing import Any

from tasks.options import DEFAULT_HYPOTHESIS

CHARS_PER_TOKEN = 4
SPECIAL_TOKENS = 2
DEFAULT_IMAGE_TOKENS = 50
# The length a text is estimated at most when its model's catalog entry names none.
DEFAULT_MAX_TOKENS = 512

Estimate = tuple[int, int, int]  # (items, real tokens, longest item's tokens)
# A chat turn's role markers and separators, roughly.
TOKENS_PER_MESSAGE = 4


def estimate_text_tokens(text: str, max_tokens: int) -> int:
    return min(len(text) // CHARS_PER_TOKEN + SPECIAL_TOKENS, max_tokens)


def estimate_texts(texts: list[str], max_tokens: int) -> tuple[int, int]:
    """(total tokens, longest item in tokens) for a list of texts."""
    total = longest = 0
    for text in texts:
        n = estimate_text_tokens(text, max_tokens)
        total += n
        if n > longest:
            longest = n
    return total, longest


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _item_tokens(op: str, item: Any, query: str, max_tokens: int, image_tokens: int,
                 max_new_tokens: int) -> int:
    if not isinstance(item, dict):
        return SPECIAL_TOKENS
    if "image" in item:
        return image_tokens
    tokens = item.get("tokens")
    if type(tokens) is list:
        # Counted, not estimated; a longer list is truncated (or refused) where it runs.
        prompt = min(len(tokens), max_tokens)
        return prompt + max_new_tokens if op == "generate" else prompt
    if "messages" in item:
        messages = item["messages"] if isinstance(item["messages"], list) else []
        chars = sum(len(_text(m.get("content"))) for m in messages if isinstance(m, dict))
        prompt = chars // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE * len(messages)
        return min(prompt, max_tokens) + max_new_tokens
    text = _text(item.get("text"))
    if op == "score":
        return estimate_text_tokens(query + text, max_tokens) + 1
    if op == "generate":
        return estimate_text_tokens(text, max_tokens) + max_new_tokens
    return estimate_text_tokens(text, max_tokens)


def estimate_request(op: str, kwargs: dict[str, Any], max_tokens: int,
                     image_tokens: int = DEFAULT_IMAGE_TOKENS,
                     default_new_tokens: int = 16) -> Estimate:
    """(items, total tokens, longest sequence in tokens) of a task's kwargs.

    Tolerates anything malformed (it counts as small): a request is checked
    properly where it runs, and a bad one must still be scheduled to be answered.
    """
    items = kwargs.get("items")
    items = items if isinstance(items, list) else []
    options = kwargs.get("options")
    options = options if isinstance(options, dict) else {}
    query = _text(kwargs.get("query"))
    new_tokens = options.get("max_tokens", default_new_tokens)
    new_tokens = new_tokens if isinstance(new_tokens, int) and new_tokens > 0 else 1
    per_item = [_item_tokens(op, item, query, max_tokens, image_tokens, new_tokens)
                for item in items]
    total, longest = sum(per_item), max(per_item, default=0)
    labels = options.get("labels")
    if op == "classify" and isinstance(labels, list) and labels:
        # Zero-shot runs every text once per label, paired with that label's hypothesis.
        template = options.get("hypothesis_template")
        template = template if isinstance(template, str) else DEFAULT_HYPOTHESIS
        hypotheses = [len(template) - 2 + len(_text(label)) for label in labels]
        extra = [h // CHARS_PER_TOKEN + 1 for h in hypotheses]
        total = total * len(labels) + sum(extra) * len(per_item)
        longest += max(extra)
    return len(items), total, longest
