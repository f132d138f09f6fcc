"""Cheap work estimates made without a tokenizer (the gateway has none).

Sub-word tokenizers give roughly one token per four characters of English;
two more are the special tokens around every sequence.
"""

from __future__ import annotations

CHARS_PER_TOKEN = 4
SPECIAL_TOKENS = 2


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
