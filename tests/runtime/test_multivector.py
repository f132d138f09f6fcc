"""The ColBERT adapter on both checkpoint layouts, against a direct torch computation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertModel

from runtimes.base import Request
from runtimes.child_side.host import ModelHost
from tasks.catalog import ModelEntry
from tasks.results import multivector_rows
from tests.tiny_encoders import (
    build_tiny_colbert_st,
    build_tiny_colbert_stanford,
    projection_weight,
)
from tests.tiny_models import build_tiny_bert

DIMS = 16
ST_LAYOUT = "test/colbert-st"
STANFORD = "test/colbert-stanford"
MARKED = "test/colbert-marked"
TEXTS = [
    "The cat sits on the mat.",
    "",
    "Grüße aus Köln: Straße und Öl. 東京は雨です。 Привет, мир! 🚀",
    "A man is playing a guitar.",
]
LONG = "word " * 200  # 202 tokens: past the 128 positions and the 32-token queries


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("colbert")
    return {"st": build_tiny_colbert_st(root / "st", dims=DIMS),
            "stanford": build_tiny_colbert_stanford(root / "stanford", dims=DIMS)}


def _entry(model_id: str, path: Path, dims: int = DIMS, **extra) -> ModelEntry:
    return ModelEntry.model_validate({"id": model_id, "adapter": "multivector", "dims": dims,
                                      "source": {"path": str(path)}, **extra})


@pytest.fixture(scope="module")
def host(dirs: dict[str, Path]) -> ModelHost:
    host = ModelHost()
    host.load([
        _entry(ST_LAYOUT, dirs["st"]),
        _entry(STANFORD, dirs["stanford"]),
        _entry(MARKED, dirs["st"], prompts={"query": "[unused0] ", "document": "[unused1] "}),
    ])
    return host


def encode(host: ModelHost, *kwargs_list: dict, model: str = ST_LAYOUT) -> list:
    requests = [Request(str(i), "encode", {"model": model, **kw})
                for i, kw in enumerate(kwargs_list)]
    return host.run_batch(model, requests)


def items(texts: list[str]) -> list[dict[str, str]]:
    return [{"text": t} for t in texts]


def vectors(result: dict) -> list[np.ndarray]:
    return [np.array(rows, dtype=np.float32).reshape(-1, result["dims"])
            for rows in multivector_rows(result)]


class Reference:
    """ColBERT by hand, one text at a time: BERT states @ W.T, then unit length."""

    def __init__(self, path: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.bert = BertModel.from_pretrained(str(path)).eval()
        self.weight = projection_weight(DIMS)

    def ids(self, text: str, query: bool, query_length: int = 32) -> list[int]:
        limit = query_length if query else 128
        return self.tokenizer(text, truncation=True, max_length=limit)["input_ids"]

    def __call__(self, texts: list[str], query: bool = False, query_length: int = 32,
                 attend: bool = True) -> list[np.ndarray]:
        return self.embed([self.ids(t, query, query_length) for t in texts], query,
                          query_length, attend)

    def embed(self, token_ids: list[list[int]], query: bool = False, query_length: int = 32,
              attend: bool = True) -> list[np.ndarray]:
        out = []
        with torch.no_grad():
            for ids in token_ids:
                n = len(ids)
                extra = query_length - n if query else 0
                ids = ids + [self.tokenizer.mask_token_id] * extra
                mask = [1] * n + [int(attend)] * extra
                hidden = self.bert(input_ids=torch.tensor([ids]),
                                   attention_mask=torch.tensor([mask])).last_hidden_state[0]
                out.append(torch.nn.functional.normalize(hidden @ self.weight.T, dim=-1).numpy())
        return out


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path]) -> Reference:
    return Reference(dirs["st"])


def assert_close(ours: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert [v.shape for v in ours] == [v.shape for v in expected]
    for a, b in zip(ours, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("model", [ST_LAYOUT, STANFORD])
def test_both_layouts_match_direct_computation(host: ModelHost, reference: Reference,
                                               model: str) -> None:
    documents, queries = encode(host, {"items": items(TEXTS)},
                                {"items": items(TEXTS), "options": {"is_query": True}},
                                model=model)
    assert documents.ok and queries.ok, (documents.error_message, queries.error_message)
    result = documents.result
    assert (result["output"], result["dims"], result["count"], result["dtype"]) == \
        ("multivector", DIMS, len(TEXTS), "float32")
    lengths = [len(reference.ids(t, query=False)) for t in TEXTS]
    assert result["lengths"] == lengths and result["usage"] == {"tokens": sum(lengths)}
    assert isinstance(result["embeddings"], bytes)
    assert len(result["embeddings"]) == sum(lengths) * DIMS * 4
    assert_close(vectors(result), reference(TEXTS))
    # Queries: every one of the 32 positions, [MASK] padding included; usage counts the text.
    assert queries.result["lengths"] == [32] * len(TEXTS)
    assert queries.result["usage"] == {"tokens": sum(lengths)}
    assert_close(vectors(queries.result), reference(TEXTS, query=True))
    for rows in vectors(result) + vectors(queries.result):
        np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-5)


def test_layouts_give_identical_vectors(host: ModelHost) -> None:
    kwargs = {"items": items(TEXTS)}
    (st,) = encode(host, kwargs)
    (stanford,) = encode(host, kwargs, model=STANFORD)
    assert st.result["embeddings"] == stanford.result["embeddings"]


def test_matches_sentence_transformers(host: ModelHost, dirs: dict[str, Path]) -> None:
    """An independent implementation: sentence-transformers' MultiVectorEncoder."""
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = Transformer(str(dirs["st"]))
    transformer.query_expansion = {"strategy": "fixed", "attend": True, "length": 32}
    dense = Dense(32, DIMS, bias=False, activation_function=torch.nn.Identity(),
                  init_weight=projection_weight(DIMS), module_input_name="token_embeddings")
    st_model = MultiVectorEncoder(
        modules=[transformer, dense, MultiVectorMask(skiplist_words=[]),
                 Normalize(module_input_name="token_embeddings")], device="cpu")
    documents, queries = encode(host, {"items": items(TEXTS)},
                                {"items": items(TEXTS), "options": {"is_query": True}})
    assert_close(vectors(documents.result),
                 [t.numpy() for t in st_model.encode_document(TEXTS)])
    assert_close(vectors(queries.result), [t.numpy() for t in st_model.encode_query(TEXTS)])


def test_deterministic_and_independent_of_batching(host: ModelHost) -> None:
    mixed = [{"items": items(TEXTS)}, {"items": items(TEXTS[:2]), "options": {"is_query": True}}]
    first = encode(host, *mixed)
    again = encode(host, *mixed)
    assert [o.result["embeddings"] for o in first] == [o.result["embeddings"] for o in again]
    one_by_one = [encode(host, {"items": [{"text": t}]})[0] for t in TEXTS]
    assert_close([vectors(o.result)[0] for o in one_by_one], vectors(first[0].result))
    chunked = ModelHost(chunk_tokens=40)
    chunked.load([_entry(ST_LAYOUT, Path(host.adapter(ST_LAYOUT).model.name_or_path))])
    for ours, small in zip(first, encode(chunked, *mixed), strict=True):
        assert ours.result["lengths"] == small.result["lengths"]
        assert_close(vectors(small.result), vectors(ours.result))


def test_truncation(host: ModelHost, reference: Reference) -> None:
    documents, queries, doc_too_long, query_too_long, query_fits = encode(
        host,
        {"items": items([LONG])},
        {"items": items([LONG]), "options": {"is_query": True}},
        {"items": items(["short", LONG]), "options": {"truncate": False}},
        {"items": items(["word " * 31]), "options": {"is_query": True, "truncate": False}},
        {"items": items(["word " * 30]), "options": {"is_query": True, "truncate": False}},
    )
    assert documents.result["lengths"] == [128] and queries.result["lengths"] == [32]
    assert_close(vectors(queries.result), reference([LONG], query=True))
    assert doc_too_long.error_code == "INPUT_TOO_LONG"
    assert "items[1]" in doc_too_long.error_message and "128" in doc_too_long.error_message
    assert query_too_long.error_code == "INPUT_TOO_LONG" and "32" in query_too_long.error_message
    assert query_fits.ok and query_fits.result["lengths"] == [32]


def test_prompt_markers_stay_one_token(host: ModelHost, reference: Reference) -> None:
    query, document = encode(host, {"items": items(["hello"]), "options": {"is_query": True}},
                             {"items": items(["hello"])}, model=MARKED)
    # [CLS] [unused0] hello [SEP]: the marker is vocabulary id 1, not "[", "unused", "##0", "]".
    assert query.result["usage"] == document.result["usage"] == {"tokens": 4}
    assert_close(vectors(query.result), reference.embed([[101, 1, 7592, 102]], query=True))
    assert_close(vectors(document.result), reference.embed([[101, 2, 7592, 102]]))
    # What an unregistered tokenizer makes of the marker.
    assert reference.ids("[unused0] hello", query=True) == [101, 1031, 15171, 2692, 1033, 7592,
                                                            102]


@pytest.mark.parametrize("options,named", [
    ({"output": "dense"}, "output"),
    ({"output": "sparse"}, "output"),
    ({"dtype": "int8"}, "dtype"),
    ({"dimensions": 8}, "dimensions"),
    ({"normalize": False}, "normalize"),
    ({"is_query": 1}, "is_query"),
])
def test_bad_options(host: ModelHost, options: dict, named: str) -> None:
    bad, good = encode(host, {"items": items(["hi"]), "options": options},
                       {"items": items(["hi"]), "options": {"normalize": True,
                                                            "output": "multivector"}})
    assert bad.error_code == "VALIDATION_ERROR" and f"options.{named}" in bad.error_message
    assert good.ok and good.result["batch"]["requests"] == 1


@pytest.mark.parametrize("layout", ["st", "stanford"])
def test_dims_mismatch_fails_at_load(dirs: dict[str, Path], layout: str) -> None:
    with pytest.raises(ValueError, match=rf"gives {DIMS}-dim vectors.*dims: 8"):
        ModelHost().load([_entry(ST_LAYOUT, dirs[layout], dims=8)])


def test_no_projection_fails_at_load(tmp_path: Path) -> None:
    plain = build_tiny_bert(tmp_path / "bert")
    with pytest.raises(ValueError, match="no ColBERT projection"):
        ModelHost().load([_entry(ST_LAYOUT, plain)])


def test_reads_colbert_settings_from_model_files(dirs: dict[str, Path], tmp_path: Path,
                                                 reference: Reference) -> None:
    """Stanford's artifact.metadata may set the query length and not attend to [MASK]s."""
    path = tmp_path / "stanford"
    shutil.copytree(dirs["stanford"], path)
    (path / "artifact.metadata").write_text(json.dumps(
        {"query_maxlen": 24, "doc_maxlen": 20, "attend_to_mask_tokens": False}))
    host = ModelHost()
    host.load([_entry(STANFORD, path)])
    queries, documents = encode(host, {"items": items(TEXTS), "options": {"is_query": True}},
                                {"items": items([LONG])}, model=STANFORD)
    assert queries.result["lengths"] == [24] * len(TEXTS)
    assert_close(vectors(queries.result),
                 reference(TEXTS, query=True, query_length=24, attend=False))
    assert documents.result["lengths"] == [20]
