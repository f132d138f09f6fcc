"""A request run as parts (tasks.split) gives the result it gives whole, for every
operation the worker splits, on real adapters and tiny models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtimes.base import Request
from runtimes.child_side.host import ModelHost
from tasks.catalog import ModelEntry
from tasks.split import merge_results, split_kwargs
from tests.tiny_classifiers import (
    build_tiny_cross_encoder,
    build_tiny_ner,
    build_tiny_nli,
    build_tiny_sentiment,
)
from tests.tiny_encoders import build_tiny_colbert_st, build_tiny_splade
from tests.tiny_models import MINILM_DIR

TEXTS = ["The cat sits on the mat.", "", "Grüße aus Köln 東京 🚀", "long " * 40,
         "Paris is the capital of France.", "A man is playing a guitar.", "Bananas."]

# model id -> (adapter, builder or None for the packaged MiniLM, extra entry fields, kwargs)
CASES: dict[str, tuple[str, Any, dict[str, Any], dict[str, Any]]] = {
    "dense": ("dense", None, {"dims": 384, "max_seq_length": 64}, {}),
    "dense-int8": ("dense", None, {"dims": 384, "max_seq_length": 64},
                   {"options": {"dtype": "int8", "dimensions": 64}}),
    "sparse": ("sparse", build_tiny_splade, {"max_seq_length": 24}, {}),
    "multivector": ("multivector", build_tiny_colbert_st, {"dims": 16, "max_seq_length": 24},
                    {}),
    "cross-encoder": ("cross-encoder", build_tiny_cross_encoder, {}, {"query": "capital?"}),
    "token-classification": ("token-classification", build_tiny_ner, {}, {}),
    "sequence-classification": ("sequence-classification", build_tiny_sentiment, {}, {}),
    "zero-shot": ("zero-shot", build_tiny_nli, {},
                  {"options": {"labels": ["sports", "music", "food"]}}),
}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelHost, dict[str, str]]:
    host = ModelHost()
    entries = []
    for name, (adapter, build, extra, _) in CASES.items():
        path = MINILM_DIR if build is None else build(tmp_path_factory.mktemp(name) / "m")
        entries.append(ModelEntry.model_validate(
            {"id": f"test/{name}", "adapter": adapter, "source": {"path": str(Path(path))},
             **extra}))
    host.load(entries)
    return host, {e.id: e.operation for e in entries}


def _run(host: tuple[ModelHost, dict[str, str]], model: str,
         kwargs: dict[str, Any]) -> dict[str, Any]:
    models, operations = host
    request = Request("r", operations[model], {"model": model, **kwargs})
    outcome = models.run_batch(model, [request])[0]
    assert outcome.ok, outcome.error_message
    assert outcome.result is not None
    return outcome.result


def _assert_close(whole: Any, merged: Any, key: str = "") -> None:
    if isinstance(whole, dict):
        assert set(whole) == set(merged), key
        for k in whole:
            if k not in ("batch",):  # the batch each ran in differs, by design
                _assert_close(whole[k], merged[k], k)
    elif isinstance(whole, list):
        assert len(whole) == len(merged), key
        for a, b in zip(whole, merged, strict=True):
            _assert_close(a, b, key)
    elif isinstance(whole, bytes):  # float32 vectors
        np.testing.assert_allclose(np.frombuffer(whole, np.float32),
                                   np.frombuffer(merged, np.float32), atol=2e-5)
    elif isinstance(whole, float):
        assert merged == pytest.approx(whole, abs=2e-5), key
    else:
        assert whole == merged, key


@pytest.mark.parametrize("name", list(CASES))
def test_a_split_request_gives_its_whole_result(host, name):
    model = f"test/{name}"
    kwargs = {"items": [{"text": t} for t in TEXTS], **CASES[name][3]}
    whole = _run(host, model, kwargs)
    parts = split_kwargs(kwargs, 3)
    assert [len(p["items"]) for p in parts] == [3, 3, 1]
    merged = merge_results([_run(host, model, p) for p in parts])
    if name == "dense-int8":  # per-row scales: each row's bytes are its own
        assert merged["embeddings"] == whole["embeddings"]
        merged = {**merged, "embeddings": b""}
        whole = {**whole, "embeddings": b""}
    _assert_close(whole, merged)


def test_merge_joins_items_and_adds_counts_and_usage():
    merged = merge_results([
        {"output": "dense", "count": 2, "embeddings": b"ab", "usage": {"tokens": 3}},
        {"output": "dense", "count": 1, "embeddings": b"c", "usage": {"tokens": 4},
         "late": "x"},
    ])
    assert merged == {"output": "dense", "count": 3, "embeddings": b"abc",
                      "usage": {"tokens": 7}, "late": "x"}
