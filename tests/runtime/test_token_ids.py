"""Token-id items on the dense adapters, PyTorch and ONNX Runtime, with the packaged MiniLM.

A text and its ids (`tokenizer(text)["input_ids"]`) give the same vector, in one batch with
texts of other requests; ids past the length limit are cut as the tokenizer cuts the text;
a tokens item gets no prompt; an id outside the vocabulary, or ids without the [CLS] and
[SEP] the tokenizer puts around every text, fail their own request only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from runtimes.child_side.host import ModelHost
from tests.tiny_classifiers import run, serve
from tests.tiny_models import MINILM_DIR

MODEL = "test/minilm-tokens"
TEXTS = ["hello", "The cat sits on the mat.", "long words " * 300]  # the last over 256


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(MINILM_DIR))


@pytest.fixture(scope="module", params=["pytorch", "onnx"])
def host(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    patch = pytest.MonkeyPatch()
    # The ONNX graph is exported into this module's own cache on first load.
    patch.setenv("SHOAL_ONNX_CACHE", str(tmp_path_factory.mktemp("onnx-cache")))
    yield serve(MODEL, "dense", MINILM_DIR, engine=request.param, dims=384,
                prompts={"query": "query: "})
    patch.undo()


def _vectors(result: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(result["embeddings"], "<f4").reshape(result["count"], result["dims"])


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]  # untruncated: the runtime cuts them


def test_a_text_and_its_ids_give_the_same_vector_in_a_mixed_batch(host: ModelHost, tokenizer):
    texts, mixed, ids = run(
        host, MODEL, "encode",
        {"items": [{"text": t} for t in TEXTS]},
        {"items": [{"tokens": _ids(tokenizer, TEXTS[0])}, {"text": TEXTS[1]},
                   {"tokens": _ids(tokenizer, TEXTS[2])}]},
        {"items": [{"tokens": _ids(tokenizer, t)} for t in TEXTS]})
    assert texts.ok and mixed.ok and ids.ok, [texts.error_message, mixed.error_message,
                                              ids.error_message]
    reference = _vectors(texts.result)
    np.testing.assert_allclose(_vectors(mixed.result), reference, atol=2e-6)
    np.testing.assert_allclose(_vectors(ids.result), reference, atol=2e-6)
    # The long one counts the 256 tokens that ran, as its text does.
    assert ids.result["usage"] == texts.result["usage"]


def test_a_tokens_item_gets_no_prompt(host: ModelHost, tokenizer):
    plain, query_text, query_ids = run(
        host, MODEL, "encode",
        {"items": [{"text": "hello"}]},
        {"items": [{"text": "hello"}], "options": {"is_query": True}},
        {"items": [{"tokens": _ids(tokenizer, "hello")}], "options": {"is_query": True}})
    np.testing.assert_allclose(_vectors(query_ids.result), _vectors(plain.result), atol=2e-6)
    assert np.abs(_vectors(query_text.result) - _vectors(plain.result)).max() > 1e-3


def test_bad_ids_fail_their_own_request_only(host: ModelHost, tokenizer):
    good, out_of_vocab, tiktoken, too_long = run(
        host, MODEL, "encode",
        {"items": [{"tokens": [101, 7592, 102]}]},
        {"items": [{"text": "fine"}, {"tokens": [101, 30522, 102]}]},
        {"items": [{"tokens": [15339]}]},  # "hello" in OpenAI's cl100k: inside BERT's range
        {"items": [{"tokens": _ids(tokenizer, TEXTS[2])}], "options": {"truncate": False}})
    assert good.ok and good.result["count"] == 1
    assert out_of_vocab.error_code == "VALIDATION_ERROR"
    assert out_of_vocab.error_message == (
        f"items[1] has token id 30522, but {MODEL}'s vocabulary has 30522 ids (0-30521): "
        "send ids from this model's own tokenizer, or send text")
    assert tiktoken.error_code == "VALIDATION_ERROR"
    assert "does not start with [CLS] (101) and end with [SEP] (102)" in tiktoken.error_message
    assert too_long.error_code == "INPUT_TOO_LONG"
    assert "items[0] has 602 tokens, over the model's 256" in too_long.error_message
