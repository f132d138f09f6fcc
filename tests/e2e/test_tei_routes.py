"""TEI's remaining routes and vLLM's token routes against the session stack (MiniLM and the
tiny family models), and the default-model rule on gateways of the test's own over the same
workers: what each answers equals what shoal's own routes answer for the same model."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.conftest import COLBERT, MINILM, RERANKER, SENTIMENT, SPLADE, TINY_CLS, UNSERVED
from tests.stack import free_port, http_status, wait_for

pytestmark = pytest.mark.e2e

TEXTS = ["The cat sits on the mat.", "Grüße aus Köln!", "a quick brown fox, 42 times"]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def ok(response: httpx.Response):
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_offsets_map_back_to_the_text(families):
    tokens = ok(post(families.url, "/tokenize", {"model": MINILM, "inputs": TEXTS}))
    assert len(tokens) == len(TEXTS)
    for text, row in zip(TEXTS, tokens, strict=True):
        assert [t["text"] for t in row if t["special"]] == ["[CLS]", "[SEP]"]
        for token in row:
            if not token["special"]:
                assert token["text"] == text[token["start"]:token["stop"]], token
        counted = ok(post(families.url, "/v1/tokenize", {"model": MINILM, "prompt": text}))
        assert counted["tokens"] == [t["id"] for t in row]
        assert counted["count"] == len(row) and counted["max_model_len"] == 256
    bare = ok(post(families.url, "/tokenize", {"model": MINILM, "inputs": "hello",
                                               "add_special_tokens": False}))
    assert [t["text"] for t in bare[0]] == ["hello"]


def test_decode_of_tokenize_round_trips(families):
    text = "the cat sits on the mat, twice."  # MiniLM lower-cases and strips accents
    ids = [t["id"] for t in ok(post(families.url, "/tokenize",
                                    {"model": MINILM, "inputs": text}))[0]]
    assert ok(post(families.url, "/decode", {"model": MINILM, "ids": ids})) == [text]
    assert ok(post(families.url, "/decode", {"model": MINILM, "ids": [ids, ids[:2]],
                                             "skip_special_tokens": False})) == \
        [f"[CLS] {text} [SEP]", "[CLS] the"]
    assert ok(post(families.url, "/v1/detokenize", {"model": MINILM, "tokens": ids})) == \
        {"prompt": f"[CLS] {text} [SEP]"}
    wrong = post(families.url, "/decode", {"model": MINILM, "ids": [10**6]})
    assert wrong.status_code == 422 and wrong.json()["error_type"] == "Validation"


def test_embed_sparse_equals_encode_sparse(families):
    got = ok(post(families.url, "/embed_sparse", {"model": SPLADE, "inputs": TEXTS}))
    want = ok(post(families.url, f"/v1/encode/{SPLADE}",
                   {"items": [{"text": t} for t in TEXTS]}))["embeddings"]
    assert len(got) == len(want)
    for row, expected in zip(got, want, strict=True):
        assert [v["index"] for v in row] == expected["indices"]
        assert [v["value"] for v in row] == pytest.approx(expected["values"], abs=1e-6)


def test_embed_all_equals_encode_multivector(families):
    got = ok(post(families.url, "/embed_all", {"model": COLBERT, "inputs": TEXTS}))
    want = ok(post(families.url, f"/v1/encode/{COLBERT}",
                   {"items": [{"text": t} for t in TEXTS]}))["embeddings"]
    for rows, expected in zip(got, want, strict=True):
        assert np.allclose(np.asarray(rows), np.asarray(expected), atol=1e-6)
    refused = post(families.url, "/embed_all", {"model": MINILM, "inputs": "a"})
    assert refused.status_code == 424 and "multivector" in refused.json()["error"]


def test_similarity_is_the_cosine_of_the_embeddings(families):
    body = {"model": MINILM, "inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}
    got = ok(post(families.url, "/similarity", body))
    vectors = np.asarray([d["embedding"] for d in ok(post(
        families.url, "/v1/embeddings", {"model": MINILM, "input": TEXTS}))["data"]])
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    assert np.allclose(got, unit[1:] @ unit[0], atol=1e-5)
    assert ok(post(families.url, "/", body)) == pytest.approx(got, abs=1e-6)  # POST / too


def test_root_routes_by_the_body_and_the_models_kind(families):
    vectors = ok(post(families.url, "/", {"model": MINILM, "inputs": TEXTS[:1]}))
    assert np.allclose(vectors, ok(post(families.url, "/embed",
                                        {"model": MINILM, "inputs": TEXTS[:1]})), atol=1e-6)
    labels = ok(post(families.url, "/", {"model": SENTIMENT, "inputs": TEXTS[0]}))
    assert {"label", "score"} == set(labels[0])
    ranked = ok(post(families.url, "/", {"model": RERANKER, "query": "cat", "texts": TEXTS}))
    assert sorted(r["index"] for r in ranked) == [0, 1, 2]
    # The session gateway serves several embedders: a body without a model is refused.
    refused = post(families.url, "/", {"inputs": "hi"})
    assert refused.status_code == 400 and "SHOAL_DEFAULT_MODELS" in refused.json()["error"]


def test_health(families):
    r = httpx.get(f"{families.url}/health", timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(f"{families.url}/", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def default_gateways(families):
    """Two gateways over the session's workers: one accepting two embedders of which only
    MiniLM is served (and one reranker), one naming TINY_CLS in SHOAL_DEFAULT_MODELS."""
    served_port, named_port = free_port(), free_port()
    gateways = [
        families.stack.gateway("gateway-served-default", served_port,
                               [MINILM, UNSERVED, RERANKER]),
        families.stack.gateway("gateway-named-default", named_port, None,
                               SHOAL_DEFAULT_MODELS=f"{TINY_CLS},{SENTIMENT}"),
    ]
    served, named = f"http://127.0.0.1:{served_port}", f"http://127.0.0.1:{named_port}"
    try:
        for url in (served, named):
            wait_for(lambda u=url: http_status(f"{u}/readyz") == 200, 60, "a gateway")
        # The served-now rule needs the workers' pool states, sent every few seconds.
        wait_for(lambda: post(served, "/embed", {"inputs": "a"}).status_code == 200, 60,
                 "the gateway to hear which models the workers serve")
        yield served, named
    finally:
        for gateway in gateways:
            gateway.stop()


def test_the_only_served_embedder_needs_no_model_name(families, default_gateways):
    served, _ = default_gateways
    want = ok(post(families.url, "/embed", {"model": MINILM, "inputs": TEXTS}))
    assert np.allclose(ok(post(served, "/embed", {"inputs": TEXTS})), want, atol=1e-6)
    assert np.allclose(ok(post(served, "/", {"inputs": TEXTS})), want, atol=1e-6)
    info = ok(httpx.get(f"{served}/info", timeout=10))
    assert info["model_id"] == MINILM and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 2048
    assert {"version", "max_batch_tokens", "tokenization_workers", "auto_truncate"} <= set(info)
    ranked = ok(post(served, "/rerank", {"query": "cat", "texts": TEXTS}))  # its only reranker
    assert len(ranked) == 3


def test_shoal_default_models_name_the_default(families, default_gateways):
    _, named = default_gateways
    vectors = ok(post(named, "/embed", {"inputs": "a"}))
    assert len(vectors[0]) == 32  # TINY_CLS's width, not MiniLM's 384
    assert ok(httpx.get(f"{named}/info", timeout=10))["model_id"] == TINY_CLS
    counted = ok(post(named, "/v1/tokenize", {"prompt": "hello"}))  # TINY_CLS's tokenizer
    assert counted["tokens"] == [101, 7592, 102] and counted["max_model_len"] is not None
    labels = ok(post(named, "/", {"inputs": "What a day", "parameters": {}}))
    assert {"label", "score"} == set(labels[0])  # huggingface_hub's text_classification
