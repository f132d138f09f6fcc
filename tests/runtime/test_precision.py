"""bf16 against fp32 on CPU, for a tiny random model of every encoder family.

Each model is loaded twice through the real path (a ModelHost whose precision overrides
the entry's, `runtimes.model_files.precision`, down to the adapter's `from_pretrained` dtype) and
answers the same requests: vectors point the same way (cosine >= 0.99 per item, per
token for ColBERT), classifiers pick the same top label, NER finds the same spans, a
reranker orders the documents the same. What a GPU adds (bf16 kernels, SDPA) is
bench/gpu_check.py's; this is the part every machine can check.

Labels are compared where fp32 decides them: a random tiny model has near-ties that
bf16's ~3 significant digits may break either way (that is bf16, not a fault). For the
same reason zero-shot is not here: the tiny NLI model scores every candidate label
within a few thousandths of 1/4; it runs through the same SequenceClassifier as
sequence-classification, which is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runtimes.base import Outcome
from runtimes.child_side.host import ModelHost
from tasks.results import embedding_arrays, multivector_rows
from tests.runtime.test_clip import image_bytes
from tests.tiny_classifiers import (
    build_tiny_cross_encoder,
    build_tiny_ner,
    build_tiny_sentiment,
    run,
    serve,
)
from tests.tiny_clip import PROJECTION_DIM, build_tiny_clip
from tests.tiny_encoders import build_tiny_colbert_st, build_tiny_splade
from tests.tiny_models import build_tiny_sentence_transformer

MIN_COSINE = 0.99
SCORE_TOLERANCE = 0.02  # probabilities: bf16 moved the tiny models' by < 0.005
DECIDED = 2 * SCORE_TOLERANCE  # a top label leading by this cannot swap places
TEXTS = [
    "The cat sits on the mat.",
    "Stocks fell sharply after the announcement.",
    "Grüße aus Köln: Straße, Äpfel und Öl. 東京は雨です。 🚀",
    "A man is playing a guitar in the park.",
    "Terrible service; we waited two hours and left hungry!",
]
NER_TEXTS = [
    "Arnold Schwarzenegger visited the Kölnerdom in Köln, then Microsoft's HQ!",
    "Dr. Jean-Pierre O'Neill (IBM) met Angela Merkel at 10:30 a.m. in São Paulo.",
]
QUERY = "Where is the cat sleeping?"


def _items(texts: list[str]) -> list[dict[str, Any]]:
    return [{"text": t} for t in texts]


@dataclass(frozen=True)
class Family:
    """One adapter family: how to build its tiny model, what to ask it."""

    adapter: str
    build: Callable[[Path], Path]
    op: str
    request: dict[str, Any]
    entry: dict[str, Any] = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        return f"test/bf16-{self.adapter}"


FAMILIES = {
    "dense": Family("dense", lambda out: build_tiny_sentence_transformer(
        out, pooling="mean", normalize=True), "encode", {"items": _items(TEXTS)},
        {"dims": 32}),
    "sparse": Family("sparse", build_tiny_splade, "encode", {"items": _items(TEXTS)}),
    "multivector": Family("multivector", build_tiny_colbert_st, "encode",
                          {"items": _items(TEXTS)}, {"dims": 16}),
    "cross-encoder": Family("cross-encoder", build_tiny_cross_encoder, "score",
                            {"query": QUERY, "items": _items(TEXTS)}),
    "sequence-classification": Family("sequence-classification", build_tiny_sentiment,
                                      "classify", {"items": _items(TEXTS)}),
    "token-classification": Family("token-classification", build_tiny_ner, "extract",
                                   {"items": _items(NER_TEXTS),
                                    "options": {"aggregation": "simple"}}),
    "clip": Family("clip", build_tiny_clip, "encode",
                   {"items": [*_items(TEXTS[:3]), {"image": image_bytes()},
                              {"image": image_bytes((10, 120, 250), (24, 48), "JPEG")},
                              {"image": image_bytes((0, 200, 0), (33, 33), "GIF")}]},
                   {"dims": PROJECTION_DIM, "image_tokens": 17}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Family, dict[str, ModelHost]]:
    """A family and its tiny model served twice: {"fp32": host, "bf16": host}."""
    family = FAMILIES[request.param]
    path = family.build(tmp_path_factory.mktemp("precision") / family.adapter)
    hosts = {precision: serve(family.model_id, family.adapter, path, precision=precision,
                              **family.entry)
             for precision in ("fp32", "bf16")}
    return family, hosts


def _answer(family: Family, host: ModelHost) -> dict[str, Any]:
    (outcome,) = run(host, family.model_id, family.op, family.request)
    assert isinstance(outcome, Outcome) and outcome.ok, outcome.error_message
    return outcome.result


def _torch_model(adapter: Any) -> torch.nn.Module:
    """The transformers model an adapter loaded (dense and the classifiers wrap theirs)."""
    holder = getattr(adapter, "encoder", None) or getattr(adapter, "classifier", None) \
        or adapter
    model = holder.model
    assert isinstance(model, torch.nn.Module)
    return model


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def _distinct(vectors: np.ndarray) -> None:
    """Different inputs get different vectors (else any parity would be vacuous)."""
    across = _cosines(vectors, np.roll(vectors, 1, axis=0))
    assert across.max() < MIN_COSINE, across


def _dense_rows(result: dict[str, Any]) -> np.ndarray:
    return np.array([list(row) for row in embedding_arrays(result)], dtype=np.float64)


def _sparse_rows(result: dict[str, Any]) -> np.ndarray:
    out = np.zeros((result["count"], result["vocab_size"]), dtype=np.float64)
    for row, embedding in enumerate(result["embeddings"]):
        out[row, embedding["indices"]] = embedding["values"]
    return out


def _labels(result: dict[str, Any]) -> list[dict[str, float]]:
    return [{e["label"]: e["score"] for e in item} for item in result["labels"]]


def _top(scores: dict[str, float]) -> tuple[str, float]:
    """The best label and its lead over the second."""
    (label, best), (_, second) = sorted(scores.items(), key=lambda kv: -kv[1])[:2]
    return label, best - second


def test_the_model_runs_in_the_precision_asked(pair):
    family, hosts = pair
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        adapter = hosts[precision].adapter(family.model_id)
        assert adapter.precision == precision
        floats = {p.dtype for p in _torch_model(adapter).parameters() if p.is_floating_point()}
        assert floats == {dtype}, (precision, floats)


def test_bf16_answers_like_fp32(pair):
    family, hosts = pair
    full, half = (_answer(family, hosts[p]) for p in ("fp32", "bf16"))
    if family.adapter in ("dense", "clip"):
        ours, theirs = _dense_rows(half), _dense_rows(full)
        assert ours.shape == theirs.shape == (len(family.request["items"]), full["dims"])
        _distinct(theirs)
        assert _cosines(ours, theirs).min() >= MIN_COSINE
    elif family.adapter == "sparse":
        ours, theirs = _sparse_rows(half), _sparse_rows(full)
        _distinct(theirs)
        assert _cosines(ours, theirs).min() >= MIN_COSINE
    elif family.adapter == "multivector":
        assert half["lengths"] == full["lengths"]
        ours = np.array([v for item in multivector_rows(half) for v in item])
        theirs = np.array([v for item in multivector_rows(full) for v in item])
        _distinct(theirs)
        assert _cosines(ours, theirs).min() >= MIN_COSINE  # every token of every item
    elif family.adapter == "cross-encoder":
        scores = np.array(full["scores"])
        assert len(set(scores.round(4))) == len(scores), "the tiny model should tell docs apart"
        assert np.argsort(half["scores"]).tolist() == np.argsort(scores).tolist()
        assert half["scores"] == pytest.approx(full["scores"], abs=SCORE_TOLERANCE)
    elif family.adapter == "sequence-classification":
        expected, ours = _labels(full), _labels(half)
        assert len({round(item["positive"], 3) for item in expected}) == len(expected), \
            "the tiny model should tell texts apart"
        # Every text decided in fp32 (a near-tie would be a coin toss in bf16 too).
        assert min(_top(item)[1] for item in expected) >= DECIDED
        assert [_top(item)[0] for item in ours] == [_top(item)[0] for item in expected]
        for mine, theirs in zip(ours, expected, strict=True):
            assert mine == pytest.approx(theirs, abs=SCORE_TOLERANCE)
    elif family.adapter == "token-classification":
        expected, ours = full["entities"], half["entities"]
        assert all(expected), "the tiny tagger should find entities in every text"
        assert [[(e["start"], e["end"]) for e in item] for item in ours] == \
            [[(e["start"], e["end"]) for e in item] for item in expected]
        sure = 0
        for mine, theirs in zip(chain.from_iterable(ours), chain.from_iterable(expected),
                                strict=True):
            assert mine["score"] == pytest.approx(theirs["score"], abs=SCORE_TOLERANCE)
            # A tag at p >= 0.5 leads the next by more than bf16 moves it; below, the
            # random tagger has near-ties among its 7 tags that bf16 may break otherwise.
            if theirs["score"] >= 0.5:
                assert mine["label"] == theirs["label"], (mine, theirs)
                sure += 1
        assert sure >= 10
    else:
        raise AssertionError(f"no comparison for {family.adapter}")
