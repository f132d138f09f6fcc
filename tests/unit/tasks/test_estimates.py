"""Work estimates the gateway writes into headers, per operation, without a tokenizer."""

from __future__ import annotations

from tasks.catalog import ModelEntry, Source
from tasks.token_estimate import DEFAULT_MAX_TOKENS, estimate_request


def test_encode_counts_text_tokens_and_a_fixed_cost_per_image():
    kwargs = {"items": [{"text": "x" * 40}, {"image": b"\x89PNG"}, {"text": ""}]}
    assert estimate_request("encode", kwargs, 512, image_tokens=50) == (3, 12 + 50 + 2, 50)


def test_long_texts_are_capped_at_the_model_limit():
    assert estimate_request("encode", {"items": [{"text": "x" * 10_000}]}, 128) == (1, 128, 128)


def test_score_counts_query_and_document_as_one_pair():
    kwargs = {"query": "q" * 40, "items": [{"text": "d" * 40}, {"text": "d" * 4}]}
    assert estimate_request("score", kwargs, 512) == (2, (22 + 1) + (13 + 1), 23)


def test_zero_shot_runs_every_text_once_per_label():
    kwargs = {"items": [{"text": "x" * 40}], "options": {"labels": ["a", "b", "c"]}}
    # 12 text tokens per pair, plus "This example is a." (18 chars: 5 tokens) per label
    assert estimate_request("classify", kwargs, 512) == (1, 3 * 12 + 3 * 5, 12 + 5)


def test_generation_counts_the_new_tokens_asked_for():
    kwargs = {"items": [{"text": "x" * 40}], "options": {"max_tokens": 100}}
    assert estimate_request("generate", kwargs, 512) == (1, 112, 112)
    chat = {"items": [{"messages": [{"role": "user", "content": "x" * 40}]}]}
    assert estimate_request("generate", chat, 512, default_new_tokens=16) == (1, 10 + 4 + 16,
                                                                              30)


def test_garbage_counts_as_small_instead_of_failing():
    assert estimate_request("score", {"items": "nope", "query": 5}, 512) == (0, 0, 0)
    assert estimate_request("generate", {"items": [7], "options": {"max_tokens": "x"}},
                            512) == (1, 2, 2)


def _entry(**fields) -> ModelEntry:
    return ModelEntry(id="m", source=Source(path="/nowhere"), **fields)


def test_an_entry_estimates_with_its_own_cap_and_image_cost():
    clip = _entry(adapter="clip", dims=4, max_seq_length=16, image_tokens=9)
    kwargs = {"items": [{"text": "x" * 400}, {"image": b"\x89PNG"}]}
    assert clip.estimate(kwargs) == estimate_request("encode", kwargs, 16, 9) == (2, 25, 16)


def test_an_entry_without_a_length_caps_at_the_default():
    dense = _entry(adapter="dense", dims=4)
    long = {"items": [{"text": "x" * 100_000}]}
    assert dense.estimate(long) == (1, DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS)


def test_an_entry_counts_its_default_new_tokens_for_generate():
    lm = _entry(adapter="causal-lm", defaults={"max_tokens": 40})
    prompt = {"items": [{"text": "x" * 40}]}
    assert lm.estimate(prompt) == (1, 12 + 40, 12 + 40)
    assert lm.estimate({**prompt, "options": {"max_tokens": 4}}) == (1, 16, 16)
