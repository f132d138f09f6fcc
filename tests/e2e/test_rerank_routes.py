"""Rerank in Cohere's and Jina's shape (POST /v1/rerank, /v2/rerank) and TEI's routes
(POST /embed, /rerank, /predict) through the whole stack, against the native routes they
stand for: the same model, the same task, the same numbers. Errors come in each API's own
shape, with a message that says what to fix, and never as a 500."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from tests.conftest import MINILM, NLI, RERANKER, SENTIMENT, TINY_CLS

pytestmark = pytest.mark.e2e

QUERY = "where does the cat sleep?"
DOCS = ["The cat sleeps on the mat.", "Stock prices fell on Monday.",
        "A kitten naps in the sun by the window.", "Paris is the capital of France.",
        "Dogs bark at the postman."]
MAX_ITEMS = 2048  # SHOAL_MAX_ITEMS of the test session (tests/conftest.py)


def post(live: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=60)


def ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def score(live: Any, texts: list[str], **options: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"query": QUERY, "items": [{"text": t} for t in texts]}
    if options:
        body["options"] = options
    return ok(post(live, f"/v1/score/{RERANKER}", body))


# --- POST /v1/rerank and /v2/rerank --------------------------------------------------------


def test_v1_rerank_answers_v1_scores_scores_in_cohere_and_jinas_shape(families):
    expected = score(families, DOCS)
    r = post(families, "/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCS})
    body = ok(r)
    assert [(x["index"], x["relevance_score"]) for x in body["results"]] == \
        [(x["index"], x["score"]) for x in expected["results"]]
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert all(set(x) == {"index", "relevance_score"} for x in body["results"])  # no document
    assert body["id"] == r.headers["x-request-id"]
    assert body["model"] == RERANKER
    tokens = expected["usage"]["tokens"]
    assert body["usage"] == {"total_tokens": tokens}
    assert body["meta"] == {"tokens": {"input_tokens": tokens, "output_tokens": 0}}


def test_top_n_return_documents_and_object_documents(families):
    expected = score(families, DOCS)["results"]
    documents: list[Any] = [{"text": DOCS[0], "id": "d0"}, DOCS[1], {"text": DOCS[2]},
                            DOCS[3], {"text": DOCS[4], "source": "web"}]
    body = ok(post(families, "/v1/rerank", {"model": RERANKER, "query": QUERY,
                                            "documents": documents, "top_n": 2,
                                            "return_documents": True}))
    assert [(x["index"], x["relevance_score"]) for x in body["results"]] == \
        [(x["index"], x["score"]) for x in expected[:2]]
    for x in body["results"]:
        sent = documents[x["index"]]
        assert x["document"] == (sent if isinstance(sent, dict) else {"text": sent})
    # top_n over the number of documents, and null (LangChain's JinaRerank sends it): all.
    for top_n in (50, None):
        every = ok(post(families, "/v1/rerank", {"model": RERANKER, "query": QUERY,
                                                 "documents": DOCS, "top_n": top_n}))
        assert [x["index"] for x in every["results"]] == [x["index"] for x in expected]


def test_rank_fields_rank_objects_on_those_fields(families):
    documents = [{"title": "Cats", "body": DOCS[0], "url": "a"},
                 {"title": "Markets", "body": DOCS[1], "url": "b"},
                 {"body": DOCS[2]}]
    texts = [f"title: Cats\nbody: {DOCS[0]}", f"title: Markets\nbody: {DOCS[1]}",
             f"body: {DOCS[2]}"]
    expected = score(families, texts)["results"]
    body = ok(post(families, "/v1/rerank", {"model": RERANKER, "query": QUERY,
                                            "documents": documents, "return_documents": True,
                                            "rank_fields": ["title", "body"]}))
    assert [(x["index"], x["relevance_score"]) for x in body["results"]] == \
        [(x["index"], x["score"]) for x in expected]
    # The object comes back as sent, with the text it was ranked on (litellm reads `text`).
    for x in body["results"]:
        assert x["document"] == {**documents[x["index"]], "text": texts[x["index"]]}


def test_v2_rerank_takes_cohere_v2s_body(families):
    """What cohere.ClientV2.rerank posts (LangChain's and LlamaIndex's CohereRerank): no
    documents back, and max_tokens_per_doc taken but not applied, which meta says."""
    expected = score(families, DOCS, top_n=3)["results"]
    body = ok(post(families, "/v2/rerank", {"model": RERANKER, "query": QUERY,
                                            "documents": DOCS, "top_n": 3,
                                            "max_tokens_per_doc": 4096}))
    assert [(x["index"], x["relevance_score"]) for x in body["results"]] == \
        [(x["index"], x["score"]) for x in expected]
    assert all("document" not in x for x in body["results"])
    assert any("max_tokens_per_doc" in w for w in body["meta"]["warnings"])
    back = ok(post(families, "/v2/rerank", {"model": RERANKER, "query": QUERY,
                                            "documents": DOCS, "return_documents": True}))
    assert all(x["document"] == {"text": DOCS[x["index"]]} for x in back["results"])


def test_rerank_without_a_model_uses_the_only_reranker(families):
    body = ok(post(families, "/v1/rerank", {"query": QUERY, "documents": DOCS}))
    assert body["model"] == RERANKER
    assert [x["index"] for x in body["results"]] == \
        [x["index"] for x in score(families, DOCS)["results"]]


def test_rerank_routes_speak_msgpack_too(families):
    expected = score(families, DOCS)["results"]
    for path, body in (("/v1/rerank", {"query": QUERY, "documents": DOCS}),
                       ("/rerank", {"query": QUERY, "texts": DOCS})):
        r = httpx.post(f"{families.url}{path}", content=msgpack.packb(body),
                       headers={"content-type": "application/msgpack"}, timeout=60)
        assert r.status_code == 200, r.text
        answer = msgpack.unpackb(r.content)
        ranks = answer["results"] if path == "/v1/rerank" else answer
        assert [x["index"] for x in ranks] == [x["index"] for x in expected]


def test_unknown_fields_are_ignored_and_named(families):
    body = ok(post(families, "/v1/rerank", {"model": RERANKER, "query": QUERY,
                                            "documents": DOCS, "max_chunks_per_doc": 10,
                                            "temperature": 0}))
    warnings = " ".join(body["meta"]["warnings"])
    assert "max_chunks_per_doc" in warnings and "'temperature'" in warnings


RERANK_ERRORS = [
    ({"model": MINILM, "query": QUERY, "documents": DOCS}, 400, "UNSUPPORTED_OPERATION",
     RERANKER),
    ({"model": "rerank-english-v3.0", "query": QUERY, "documents": DOCS}, 404,
     "MODEL_NOT_FOUND", RERANKER),
    ({"model": RERANKER, "documents": DOCS}, 400, "VALIDATION_ERROR", "'query'"),
    ({"model": RERANKER, "query": "", "documents": DOCS}, 400, "VALIDATION_ERROR", "'query'"),
    ({"model": RERANKER, "query": QUERY, "documents": []}, 400, "VALIDATION_ERROR",
     "'documents'"),
    ({"model": RERANKER, "query": QUERY}, 400, "VALIDATION_ERROR", "'documents'"),
    ({"model": RERANKER, "query": QUERY, "documents": [{"title": "x"}]}, 400,
     "VALIDATION_ERROR", "rank_fields"),
    ({"model": RERANKER, "query": QUERY, "documents": [3]}, 400, "VALIDATION_ERROR",
     "documents[0]"),
    ({"model": RERANKER, "query": QUERY, "documents": ["d", {"text": "x", "id": 5}]}, 400,
     "VALIDATION_ERROR", "documents[1] must map field names to strings"),
    ({"model": RERANKER, "query": QUERY, "documents": DOCS, "top_n": 0}, 400,
     "VALIDATION_ERROR", "'top_n'"),
    ({"model": RERANKER, "query": QUERY, "documents": DOCS, "return_documents": "yes"}, 400,
     "VALIDATION_ERROR", "'return_documents'"),
    ({"model": RERANKER, "query": QUERY, "documents": [{"a": "x"}], "rank_fields": ["b"]},
     400, "VALIDATION_ERROR", "rank_fields"),
    # 400, not 413: Cohere's SDK types 400 as its BadRequestError, 413 as a bare ApiError
    ({"model": RERANKER, "query": QUERY, "documents": ["d"] * (MAX_ITEMS + 1)}, 400,
     "PAYLOAD_TOO_LARGE", f"limit of {MAX_ITEMS}"),
    ([QUERY], 400, "VALIDATION_ERROR", "object"),
]


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_errors_in_cohere_and_jinas_shape(families, path):
    for body, status, code, named in RERANK_ERRORS:
        r = post(families, path, body)
        assert r.status_code == status, (body, r.text)
        error = r.json()
        # Cohere reads `message`, Jina's clients `detail`, shoal's `error.code`.
        assert error["message"] == error["detail"] == error["error"]["message"], error
        assert error["error"]["code"] == code and named in error["message"], (body, error)
        assert r.headers["x-should-retry"] == "false"  # sent again, it fails again
    r = httpx.post(f"{families.url}{path}", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_REQUEST", r.text
    # The router's refusals come in the route's shape too.
    r = httpx.get(f"{families.url}{path}", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "METHOD_NOT_ALLOWED", r.text
    assert r.json()["detail"] == r.json()["message"]


# --- TEI: POST /embed, /rerank, /predict ---------------------------------------------------


def embeddings(live: Any, texts: list[str], **extra: Any) -> np.ndarray:
    body = ok(post(live, "/v1/embeddings", {"model": MINILM, "input": texts, **extra}))
    return np.array([row["embedding"] for row in body["data"]], dtype=np.float32)


def test_tei_embed_answers_v1_embeddings_vectors(families):
    expected = embeddings(families, DOCS)
    vectors = np.array(ok(post(families, "/embed", {"model": MINILM, "inputs": DOCS})),
                       dtype=np.float32)
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=1e-6)
    one = ok(post(families, "/embed", {"model": MINILM, "inputs": DOCS[0]}))
    assert len(one) == 1  # TEI answers a single input as a batch of one
    np.testing.assert_allclose(np.array(one[0], dtype=np.float32), expected[0], atol=1e-6)
    short = ok(post(families, "/embed", {"model": MINILM, "inputs": DOCS[:2],
                                         "dimensions": 64}))
    np.testing.assert_allclose(np.array(short, dtype=np.float32),
                               embeddings(families, DOCS[:2], dimensions=64), atol=1e-6)
    raw = np.array(ok(post(families, "/embed", {"model": MINILM, "inputs": DOCS[:2],
                                                "normalize": False})), dtype=np.float32)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True),
                               expected[:2], atol=1e-6)


def test_tei_embed_takes_token_ids(families):
    from transformers import AutoTokenizer

    from tests.tiny_models import MINILM_DIR

    ids = AutoTokenizer.from_pretrained(MINILM_DIR)(DOCS[:2])["input_ids"]
    expected = embeddings(families, DOCS[:2])
    batch = np.array(ok(post(families, "/embed", {"model": MINILM, "inputs": ids})),
                     dtype=np.float32)
    np.testing.assert_allclose(batch, expected, atol=1e-6)
    one = ok(post(families, "/embed", {"model": MINILM, "inputs": ids[0]}))
    np.testing.assert_allclose(np.array(one, dtype=np.float32), expected[:1], atol=1e-6)


def test_tei_rerank_answers_v1_scores_scores(families):
    expected = score(families, DOCS)["results"]
    ranks = ok(post(families, "/rerank", {"query": QUERY, "texts": DOCS}))  # the only reranker
    assert ranks == [{"index": x["index"], "score": x["score"]} for x in expected]
    texts = ok(post(families, "/rerank", {"model": RERANKER, "query": QUERY, "texts": DOCS,
                                          "return_text": True, "truncate": True,
                                          "truncation_direction": "Right"}))
    assert texts == [{"index": x["index"], "text": DOCS[x["index"]], "score": x["score"]}
                     for x in expected]
    logits = score(families, DOCS, activation="none")["results"]
    raw = ok(post(families, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}))
    assert raw == [{"index": x["index"], "score": x["score"]} for x in logits]
    best = ok(post(families, "/rerank", {"query": QUERY, "texts": DOCS, "top_n": 2}))
    assert best == [{"index": x["index"], "score": x["score"]} for x in expected[:2]]


def test_tei_rerank_answers_a_cohere_body_as_v1_rerank(families):
    # What litellm's infinity/ and hosted_vllm/ providers post to {api_base}/rerank.
    body = {"model": RERANKER, "query": QUERY, "documents": DOCS, "top_n": 2,
            "return_documents": True}
    assert ok(post(families, "/rerank", body))["results"] == \
        ok(post(families, "/v1/rerank", body))["results"]


def classify(live: Any, texts: list[str]) -> list[list[dict[str, Any]]]:
    """/v1/classify's labels in TEI's shape: `[{"score", "label"}]` per text, best first."""
    labels = ok(post(live, f"/v1/classify/{SENTIMENT}",
                     {"items": [{"text": t} for t in texts]}))["labels"]
    return [[{"score": p["score"], "label": p["label"]} for p in row] for row in labels]


def test_tei_predict_answers_v1_classifys_labels(families):
    # The only classifier with labels of its own (the zero-shot NLI model needs labels).
    single = classify(families, DOCS[:1])[0]
    assert ok(post(families, "/predict", {"inputs": DOCS[0]})) == single
    assert ok(post(families, "/predict", {"inputs": [DOCS[0]]})) == single
    batch = ok(post(families, "/predict", {"model": SENTIMENT,
                                           "inputs": [[t] for t in DOCS[:3]]}))
    assert batch == classify(families, DOCS[:3])


TEI_ERRORS = [
    ("/embed", {"inputs": DOCS}, 400, "Validation", TINY_CLS),  # several embedders: name one
    ("/embed", {"model": MINILM, "inputs": []}, 400, "Empty", "`inputs` cannot be empty"),
    ("/embed", {"model": MINILM, "inputs": {"text": "x"}}, 422, "Validation", "'inputs'"),
    ("/embed", {"model": MINILM, "inputs": ["x", 5]}, 422, "Validation", "inputs[1]"),
    ("/embed", {"model": MINILM, "inputs": "x", "truncation_direction": "Left"}, 422,
     "Validation", "Right"),
    ("/embed", {"model": MINILM, "inputs": "x", "prompt_name": "summary"}, 422, "Validation",
     "'query'"),
    ("/embed", {"model": MINILM, "inputs": "x", "normalize": "yes"}, 422, "Validation",
     "'normalize'"),
    ("/embed", {"model": RERANKER, "inputs": "x"}, 424, "Backend", MINILM),
    ("/embed", {"model": "nope/nope", "inputs": "x"}, 404, "Validation", MINILM),
    ("/embed", {"model": MINILM, "inputs": ["x"] * (MAX_ITEMS + 1)}, 413, "Validation",
     f"limit of {MAX_ITEMS}"),
    ("/rerank", {"texts": DOCS}, 422, "Validation", "'query'"),
    ("/rerank", {"query": QUERY, "texts": []}, 400, "Empty", "`texts` cannot be empty"),
    ("/rerank", {"query": QUERY, "texts": "one text"}, 422, "Validation", "'texts'"),
    ("/rerank", {"model": MINILM, "query": QUERY, "texts": DOCS}, 424, "Backend", RERANKER),
    ("/rerank", {"query": QUERY, "texts": ["d"] * (MAX_ITEMS + 1)}, 413, "Validation",
     f"limit of {MAX_ITEMS}"),
    ("/predict", {"inputs": ["a text", "another"]}, 422, "Validation", "pair"),
    ("/predict", {"inputs": [["a"], ["b", "c"]]}, 422, "Validation", "inputs[1]"),
    ("/predict", {"inputs": []}, 400, "Empty", "`inputs` cannot be empty"),
    ("/predict", {"inputs": "x", "raw_scores": True}, 422, "Validation", "raw_scores"),
    ("/predict", {"model": NLI, "inputs": "x"}, 424, "Backend", SENTIMENT),
    ("/predict", {"inputs": 7}, 422, "Validation", "'inputs'"),
]


def test_tei_errors_in_teis_shape(families):
    for path, body, status, error_type, named in TEI_ERRORS:
        r = post(families, path, body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()
        assert set(error) == {"error", "error_type"}, error
        assert error["error_type"] == error_type and named in error["error"], (path, error)
    for path in ("/embed", "/rerank", "/predict"):
        r = post(families, path, ["not", "an", "object"])
        assert r.status_code == 422 and r.json()["error_type"] == "Validation", r.text
        assert r.headers["x-should-retry"] == "false"
        r = httpx.get(f"{families.url}{path}", timeout=30)
        assert r.status_code == 405 and set(r.json()) == {"error", "error_type"}, r.text
