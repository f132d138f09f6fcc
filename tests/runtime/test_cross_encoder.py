"""The cross-encoder adapter against sentence-transformers and plain transformers."""

from __future__ import annotations

import msgpack
import pytest
import torch
from sentence_transformers import CrossEncoder
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.tiny_classifiers import build_tiny_cross_encoder, run, serve

QUERY = "Where is the cat sleeping?"
DOCS = [
    "The cat sleeps on the warm mat by the window.",
    "",
    "Stocks fell sharply after the announcement.",
    "Grüße aus Köln: Straße, Äpfel und Öl. 東京は雨です。 🚀",
    "cat " * 300,  # far past the 128-token limit: truncated like sentence-transformers
]
ONE = "test/reranker"
THREE = "test/reranker-3"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross-encoder")
    return {ONE: build_tiny_cross_encoder(root / "one"),
            THREE: build_tiny_cross_encoder(root / "three", num_labels=3)}


@pytest.fixture(scope="module")
def hosts(paths):
    return {model_id: serve(model_id, "cross-encoder", path) for model_id, path in paths.items()}


def _score(hosts, model_id, docs=DOCS, query=QUERY, **options):
    (outcome,) = run(hosts[model_id], model_id, "score",
                     {"query": query, "items": [{"text": d} for d in docs], "options": options})
    assert outcome.ok, outcome.error_message
    return outcome.result


def _logits(path, docs=DOCS, query=QUERY) -> torch.Tensor:
    """The model run directly by transformers, pairs truncated longest side first."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    inputs = tokenizer([query] * len(docs), docs, truncation="longest_first", max_length=128,
                       padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model(**inputs).logits


def test_one_logit_matches_cross_encoder_predict(hosts, paths):
    reference = CrossEncoder(str(paths[ONE]), device="cpu")
    assert isinstance(reference.activation_fn, torch.nn.Sigmoid)  # its default for one logit
    expected = reference.predict([(QUERY, d) for d in DOCS])
    result = _score(hosts, ONE)
    assert result["scores"] == pytest.approx(expected.tolist(), abs=1e-5)
    assert len(set(result["scores"])) == len(DOCS), "the tiny model should tell docs apart"
    assert all(type(s) is float for s in result["scores"])
    msgpack.packb(result)


def test_one_logit_activations_match_transformers(hosts, paths):
    logits = _logits(paths[ONE])[:, 0]
    assert _score(hosts, ONE, activation="none")["scores"] == \
        pytest.approx(logits.tolist(), abs=1e-5)
    assert _score(hosts, ONE, activation="sigmoid")["scores"] == \
        pytest.approx(logits.sigmoid().tolist(), abs=1e-6)


def test_several_labels_score_the_last_class(hosts, paths):
    logits = _logits(paths[THREE])
    predicted = CrossEncoder(str(paths[THREE]), device="cpu").predict(
        [(QUERY, d) for d in DOCS])  # raw logits: its default for several labels
    assert predicted.shape == (len(DOCS), 3)
    torch.testing.assert_close(torch.from_numpy(predicted), logits, atol=1e-5, rtol=0)
    last = logits.softmax(dim=-1)[:, -1]
    assert _score(hosts, THREE)["scores"] == pytest.approx(last.tolist(), abs=1e-6)
    assert _score(hosts, THREE, activation="softmax")["scores"] == \
        pytest.approx(last.tolist(), abs=1e-6)
    assert _score(hosts, THREE, activation="none")["scores"] == \
        pytest.approx(logits[:, -1].tolist(), abs=1e-5)
    assert _score(hosts, THREE, activation="sigmoid")["scores"] == \
        pytest.approx(logits[:, -1].sigmoid().tolist(), abs=1e-6)


def test_softmax_of_one_logit_is_refused(hosts):
    (outcome,) = run(hosts[ONE], ONE, "score", {"query": QUERY, "items": [{"text": "x"}],
                                                "options": {"activation": "softmax"}})
    assert outcome.error_code == "VALIDATION_ERROR" and "'sigmoid'" in outcome.error_message


def test_order_and_batching_do_not_change_scores(hosts, paths):
    scores = _score(hosts, ONE)["scores"]
    assert _score(hosts, ONE, docs=DOCS[::-1])["scores"] == pytest.approx(scores[::-1], abs=1e-6)
    outcomes = run(hosts[ONE], ONE, "score",
                   *[{"query": QUERY, "items": [{"text": d}]} for d in DOCS],
                   {"query": "stock market news", "items": [{"text": DOCS[2]}]})
    assert [o.result["scores"][0] for o in outcomes[:-1]] == pytest.approx(scores, abs=1e-6)
    assert outcomes[-1].result["scores"][0] != pytest.approx(scores[2], abs=1e-4)
    chunked = serve(ONE, "cross-encoder", paths[ONE], chunk_tokens=64)
    assert _score({ONE: chunked}, ONE)["scores"] == pytest.approx(scores, abs=1e-6)


def test_usage_counts_pair_tokens(hosts, paths):
    tokenizer = AutoTokenizer.from_pretrained(str(paths[ONE]))
    pairs = tokenizer([QUERY] * len(DOCS), DOCS, truncation="longest_first", max_length=128)
    assert _score(hosts, ONE)["usage"] == {"tokens": sum(map(len, pairs["input_ids"]))}


def test_too_long_without_truncation(hosts):
    too_long, fits = run(hosts[ONE], ONE, "score",
                         {"query": QUERY, "items": [{"text": "a cat"}, {"text": DOCS[-1]}],
                          "options": {"truncate": False}},
                         {"query": QUERY, "items": [{"text": DOCS[0]}],
                          "options": {"truncate": False}})
    assert too_long.error_code == "INPUT_TOO_LONG"
    assert "items[1]" in too_long.error_message and "truncate" in too_long.error_message
    assert fits.ok and fits.result["batch"]["requests"] == 1


def test_missing_query_is_a_validation_error(hosts):
    (outcome,) = run(hosts[ONE], ONE, "score", {"items": [{"text": "x"}]})
    assert outcome.error_code == "VALIDATION_ERROR" and "query" in outcome.error_message
