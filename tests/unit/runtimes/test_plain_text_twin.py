"""Plain texts tokenized by a lighter copy of the tokenizer
(`runtimes.families.text.plain_text_twin`)
get exactly the ids the tokenizer itself gives; any other text goes through the tokenizer,
and a batch of both keeps its order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from runtimes.families.text import encode_texts, is_plain, plain_text_twin
from tests.tiny_models import MINILM_DIR

LIMIT = 128


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MINILM_DIR))


def reference(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, truncation=True, max_length=LIMIT, padding=False)["input_ids"]


PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)
ANY = st.text(max_size=80)


def test_minilm_has_a_twin_that_only_lowercases(tokenizer):
    twin = plain_text_twin(tokenizer)
    assert twin is not None and type(twin.normalizer).__name__ == "Lowercase"
    assert plain_text_twin(tokenizer) is twin  # made once


@settings(max_examples=300, deadline=None)
@given(st.lists(PRINTABLE, min_size=1, max_size=8))
def test_plain_texts_get_the_tokenizers_own_ids(tokenizer, texts):
    assert all(is_plain(t) for t in texts)
    ids, types = encode_texts(tokenizer, texts, LIMIT)
    assert ids == reference(tokenizer, texts)
    assert types == [[0] * len(row) for row in ids]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(PRINTABLE, ANY), min_size=1, max_size=8))
def test_a_mixed_batch_keeps_its_order_and_the_tokenizers_ids(tokenizer, texts):
    ids, _ = encode_texts(tokenizer, texts, LIMIT)
    assert ids == reference(tokenizer, texts)


@pytest.mark.parametrize("text", [
    "Grüße aus Köln", "naïve café", "tab\there", "line\nbreak", "nul\x00byte", "\x7fdel",
    "CJK 中文 mixed", "Ünïcödé ÀÉÎ", "\u00a0non-breaking space",
    "\uff46\uff55\uff4c\uff4c width", "",
])
def test_what_the_normaliser_changes_is_not_plain_and_keeps_the_full_path(tokenizer, text):
    assert not is_plain(text) or text == ""
    ids, _ = encode_texts(tokenizer, [text, "A Plain Text."], LIMIT)
    assert ids == reference(tokenizer, [text, "A Plain Text."])


def test_a_tokenizer_without_a_twin_encodes_everything_itself_an_empty_batch_too():
    from tokenizers import normalizers

    other = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    other.backend_tokenizer.normalizer = normalizers.Lowercase()  # not a BERT normaliser
    assert plain_text_twin(other) is None
    assert encode_texts(other, [], LIMIT) == ([], [])
    ids, _ = encode_texts(other, ["A Plain Text.", "naïve"], LIMIT)
    assert ids == reference(other, ["A Plain Text.", "naïve"])
