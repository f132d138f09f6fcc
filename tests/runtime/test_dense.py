"""The dense adapter against sentence-transformers on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from runtimes.base import Request
from runtimes.child_side.host import ModelHost
from runtimes.pytorch.dense import DenseEncoder
from tests.tiny_models import MINILM_DIR, build_tiny_sentence_transformer

TEXTS = [
    "The cat sits on the mat.",
    "",
    "Grüße aus Köln: Straße, Äpfel und Öl. 東京は雨です。 Привет, мир! 🚀",
    "long " * 600,  # far past the 256-token limit: truncated like sentence-transformers
    "A man is playing a guitar.",
]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.fixture(scope="module")
def minilm() -> DenseEncoder:
    return DenseEncoder(str(MINILM_DIR))


def test_minilm_reads_its_sentence_transformers_config(minilm):
    assert (minilm.pooling, minilm.normalize, minilm.max_seq_length, minilm.dims) == \
        ("mean", True, 256, 384)


def test_minilm_matches_sentence_transformers(minilm):
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu").encode(TEXTS)
    ours = minilm.encode(TEXTS)
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), 384)
    assert _cosines(ours, reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


def test_minilm_semantic_order(minilm):
    a, b, c = minilm.encode(["A man is eating food.", "A man is eating a meal.",
                             "The stock market fell sharply."])
    assert a @ b > a @ c + 0.3


def test_batching_does_not_change_results(minilm):
    one_by_one = np.vstack([minilm.encode([t]) for t in TEXTS])
    together = minilm.encode(TEXTS)
    assert _cosines(one_by_one, together).min() >= 0.9999


@pytest.mark.parametrize("pooling,normalize", [("cls", True), ("mean", False),
                                                ("lasttoken", False)])
def test_tiny_models_match_sentence_transformers(tmp_path, pooling, normalize):
    path = build_tiny_sentence_transformer(tmp_path / pooling, pooling=pooling,
                                           normalize=normalize, max_seq_length=16)
    ours = DenseEncoder(str(path))
    assert (ours.pooling, ours.normalize, ours.max_seq_length) == (pooling, normalize, 16)
    reference = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    result = ours.encode(TEXTS)
    assert _cosines(result, reference).min() >= 0.9999
    np.testing.assert_allclose(result, reference, rtol=1e-3, atol=1e-5)


def test_chunking_by_padded_tokens_keeps_results(tmp_path):
    path = build_tiny_sentence_transformer(tmp_path / "m", pooling="mean", normalize=True)
    whole = DenseEncoder(str(path)).encode(TEXTS * 3)
    chunked = DenseEncoder(str(path), chunk_tokens=40).encode(TEXTS * 3)
    assert _cosines(whole, chunked).min() >= 0.9999


@pytest.fixture(scope="module")
def host() -> ModelHost:
    from tasks.catalog import load_entry
    from tasks.settings import REPO_ROOT

    host = ModelHost()
    host.load([load_entry(REPO_ROOT / "models" / "all-minilm-l6-v2.yaml")])
    return host


class TestHost:
    def run(self, host, *kwargs_list):
        requests = [Request(str(i), "encode", kw) for i, kw in enumerate(kwargs_list)]
        return host.run_batch("sentence-transformers/all-MiniLM-L6-v2", requests)

    def test_bad_request_fails_alone(self, host):
        good, bad, too_long = self.run(
            host,
            {"items": [{"text": "hi"}, {"text": "there"}], "options": {"dimensions": 8}},
            {"items": [{"text": 3}]},
            {"items": [{"text": "word " * 400}], "options": {"truncate": False}},
        )
        assert good.ok and good.result["count"] == 2 and good.result["dims"] == 8
        vectors = np.frombuffer(good.result["embeddings"], "<f4").reshape(2, 8)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
        batch = good.result["batch"]
        assert (batch["requests"], batch["items"]) == (1, 2)  # the invalid ones did not run
        assert bad.error_code == "VALIDATION_ERROR" and "items[0]" in bad.error_message
        assert too_long.error_code == "INPUT_TOO_LONG" and "truncate" in too_long.error_message

    def test_unknown_model_and_operation(self, host):
        (outcome,) = host.run_batch("nope", [Request("x", "encode", {})])
        assert outcome.error_code == "MODEL_NOT_FOUND"
        (outcome,) = self.run(host, {"items": [{"text": "x"}]})
        assert outcome.ok
        (outcome,) = host.run_batch("sentence-transformers/all-MiniLM-L6-v2",
                                    [Request("y", "score", {})])
        assert outcome.error_code == "UNSUPPORTED_OPERATION"
