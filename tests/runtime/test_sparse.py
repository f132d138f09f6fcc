"""The SPLADE adapter against transformers (and sentence-transformers) on the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from runtimes.base import Request
from runtimes.child_side.host import ModelHost
from tasks.catalog import ModelEntry
from tests.tiny_encoders import build_tiny_splade

MODEL = "test/tiny-splade"
PROMPTED = "test/tiny-splade-prompted"
MAX_LEN = 24
TEXTS = [
    "The cat sits on the mat.",
    "",
    "Grüße aus Köln: Straße und Öl. 東京は雨です。 Привет, мир! 🚀",
    "long " * 60,  # past MAX_LEN: truncated
    "A man is playing a guitar.",
]


@pytest.fixture(scope="module")
def splade_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_splade(tmp_path_factory.mktemp("splade") / "model")


def _entry(model_id: str, path: Path, **extra) -> ModelEntry:
    return ModelEntry.model_validate({"id": model_id, "adapter": "sparse",
                                      "source": {"path": str(path)}, **extra})


@pytest.fixture(scope="module")
def host(splade_dir: Path) -> ModelHost:
    host = ModelHost()
    host.load([
        _entry(MODEL, splade_dir, max_seq_length=MAX_LEN),
        _entry(PROMPTED, splade_dir, max_seq_length=MAX_LEN,
               prompts={"query": "query: ", "document": "passage: "}),
    ])
    return host


def encode(host: ModelHost, *kwargs_list: dict, model: str = MODEL) -> list:
    requests = [Request(str(i), "encode", {"model": model, **kw})
                for i, kw in enumerate(kwargs_list)]
    return host.run_batch(model, requests)


def items(texts: list[str]) -> list[dict[str, str]]:
    return [{"text": t} for t in texts]


def dense(result: dict) -> np.ndarray:
    out = np.zeros((result["count"], result["vocab_size"]), dtype=np.float32)
    for row, embedding in enumerate(result["embeddings"]):
        out[row, embedding["indices"]] = embedding["values"]
    return out


def reference(path: Path, texts: list[str], max_len: int = MAX_LEN, pooling: str = "max",
              activation: str = "relu") -> np.ndarray:
    """SPLADE computed one text at a time, so no padding is involved."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForMaskedLM.from_pretrained(str(path)).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text, truncation=True, max_length=max_len, return_tensors="pt")
            weights = torch.log1p(torch.relu(model(**inputs).logits[0]))
            if activation == "log1p_relu":
                weights = torch.log1p(weights)
            rows.append(weights.amax(0) if pooling == "max" else weights.sum(0))
    return torch.stack(rows).numpy()


def test_result_format(host: ModelHost) -> None:
    (outcome,) = encode(host, {"items": items(TEXTS)})
    assert outcome.ok, outcome.error_message
    result = outcome.result
    assert (result["output"], result["count"], result["vocab_size"]) == ("sparse", 5, 30522)
    tokenizer = AutoTokenizer.from_pretrained(str(host.adapter(MODEL).model.name_or_path))
    lengths = [len(ids) for ids in tokenizer(TEXTS, truncation=True,
                                             max_length=MAX_LEN)["input_ids"]]
    assert result["usage"] == {"tokens": sum(lengths)}
    assert max(lengths) == MAX_LEN
    for embedding in result["embeddings"]:
        indices, values = embedding["indices"], embedding["values"]
        assert set(embedding) == {"indices", "values"}
        assert len(indices) == len(values) > 0
        assert all(type(i) is int for i in indices) and all(type(v) is float for v in values)
        assert indices == sorted(set(indices)) and indices[0] >= 0 and indices[-1] < 30522
        assert min(values) > 0
        # Sparse like a trained model's vectors (the tiny model's logit bias sees to it).
        assert len(indices) < 3000


def test_matches_transformers(host: ModelHost, splade_dir: Path) -> None:
    (outcome,) = encode(host, {"items": items(TEXTS)})
    np.testing.assert_allclose(dense(outcome.result), reference(splade_dir, TEXTS), atol=1e-5)


def test_matches_sentence_transformers(host: ModelHost, splade_dir: Path) -> None:
    from sentence_transformers.sparse_encoder import SparseEncoder

    st_model = SparseEncoder(str(splade_dir), device="cpu")
    st_model.max_seq_length = MAX_LEN
    expected = st_model.encode(TEXTS, convert_to_tensor=True).to_dense().cpu().numpy()
    (outcome,) = encode(host, {"items": items(TEXTS)})
    np.testing.assert_allclose(dense(outcome.result), expected, atol=1e-5)


def test_deterministic_and_independent_of_batching(host: ModelHost) -> None:
    (together,) = encode(host, {"items": items(TEXTS)})
    (again,) = encode(host, {"items": items(TEXTS)})
    assert again.result["embeddings"] == together.result["embeddings"]
    one_by_one = encode(host, *({"items": [{"text": t}]} for t in TEXTS))
    assert [o.result["count"] for o in one_by_one] == [1] * len(TEXTS)
    np.testing.assert_allclose(np.vstack([dense(o.result) for o in one_by_one]),
                               dense(together.result), atol=1e-5)


def test_small_forward_passes_keep_results(splade_dir: Path, host: ModelHost) -> None:
    chunked = ModelHost(chunk_tokens=30)
    chunked.load([_entry(MODEL, splade_dir, max_seq_length=MAX_LEN)])
    (small,) = encode(chunked, {"items": items(TEXTS * 2)})
    (whole,) = encode(host, {"items": items(TEXTS * 2)})
    np.testing.assert_allclose(dense(small.result), dense(whole.result), atol=1e-5)


def test_prompts(host: ModelHost, splade_dir: Path) -> None:
    query, document = encode(host, {"items": items(TEXTS[:2]), "options": {"is_query": True}},
                             {"items": items(TEXTS[:2])}, model=PROMPTED)
    np.testing.assert_allclose(dense(query.result),
                               reference(splade_dir, ["query: " + t for t in TEXTS[:2]]),
                               atol=1e-5)
    np.testing.assert_allclose(dense(document.result),
                               reference(splade_dir, ["passage: " + t for t in TEXTS[:2]]),
                               atol=1e-5)


def test_truncate_false(host: ModelHost) -> None:
    too_long, fits = encode(
        host,
        {"items": items(["short", "word " * 40]), "options": {"truncate": False}},
        {"items": items(["word " * 20]), "options": {"truncate": False}},
    )
    assert too_long.error_code == "INPUT_TOO_LONG"
    assert "items[1]" in too_long.error_message and "truncate" in too_long.error_message
    assert fits.ok and fits.result["usage"]["tokens"] == 22


@pytest.mark.parametrize("options,named", [
    ({"output": "dense"}, "output"),
    ({"output": "multivector"}, "output"),
    ({"dtype": "float16"}, "dtype"),
    ({"dtype": "binary"}, "dtype"),
    ({"dimensions": 8}, "dimensions"),
    ({"normalize": True}, "normalize"),
    ({"truncate": "yes"}, "truncate"),
])
def test_bad_options(host: ModelHost, options: dict, named: str) -> None:
    bad, good = encode(host, {"items": items(["hi"]), "options": options},
                       {"items": items(["hi"]), "options": {"normalize": False,
                                                            "output": "sparse"}})
    assert bad.error_code == "VALIDATION_ERROR" and f"options.{named}" in bad.error_message
    assert good.ok and good.result["batch"]["requests"] == 1


def _with_modules(source: Path, out: Path, pooling_config: dict,
                  extra_module: str | None = None) -> Path:
    """The model as a sentence-transformers SparseEncoder save with the given pooling."""
    shutil.copytree(source, out)
    modules = [
        {"idx": 0, "name": "0", "path": "",
         "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"},
    ]
    if extra_module:
        modules.append({"idx": 2, "name": "2", "path": "", "type": extra_module})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_SpladePooling").mkdir()
    (out / "1_SpladePooling" / "config.json").write_text(json.dumps(pooling_config))
    return out


def test_reads_pooling_from_sentence_transformers_files(splade_dir: Path, tmp_path: Path) -> None:
    path = _with_modules(splade_dir, tmp_path / "m",
                         {"pooling_strategy": "sum", "activation_function": "log1p_relu"})
    host = ModelHost()
    host.load([_entry(MODEL, path, max_seq_length=MAX_LEN)])
    (outcome,) = encode(host, {"items": items(TEXTS)})
    expected = reference(splade_dir, TEXTS, pooling="sum", activation="log1p_relu")
    np.testing.assert_allclose(dense(outcome.result), expected, rtol=1e-5, atol=1e-5)


def test_unsupported_sparse_modules_fail_at_load(splade_dir: Path, tmp_path: Path) -> None:
    path = _with_modules(splade_dir, tmp_path / "m", {"pooling_strategy": "max"},
                         "sentence_transformers.sparse_encoder.modules.SparseStaticEmbedding")
    with pytest.raises(ValueError, match=r"SparseStaticEmbedding.*not supported"):
        ModelHost().load([_entry(MODEL, path)])
    bad_pooling = _with_modules(splade_dir, tmp_path / "p", {"pooling_strategy": "mean"})
    with pytest.raises(ValueError, match="pooling 'mean'"):
        ModelHost().load([_entry(MODEL, bad_pooling)])


def test_dims_must_be_the_vocabulary_size(splade_dir: Path) -> None:
    ModelHost().load([_entry(MODEL, splade_dir, dims=30522)])
    with pytest.raises(ValueError, match=r"30522-term vocabulary.*dims: 128"):
        ModelHost().load([_entry(MODEL, splade_dir, dims=128)])
