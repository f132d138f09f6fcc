"""The ONNX Runtime adapters against the PyTorch adapters on the same tiny weights.

Each family's tiny random model is exported here (`runtimes.onnx.export`, fp32 and
int8, into this module's own cache) and served by two hosts, PyTorch's and ONNX
Runtime's: fp32 gives the same results (cosine >= 0.9999, the same labels and spans),
int8 close ones (cosine >= 0.99, the same best label). Then what a user of the ONNX
runtime relies on: serving imports no torch, a missing graph is exported (or named
with the command to make it), and a corrupt one fails its model's load only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtimes.base import LoadFailed, Request
from runtimes.child_side.host import ModelHost
from runtimes.onnx.export import export_graph
from runtimes.onnx.graphs import GraphMissing
from runtimes.worker_side.process import ProcessRuntime
from tasks.catalog import ModelEntry
from tests.tiny_classifiers import (
    build_tiny_cross_encoder,
    build_tiny_ner,
    build_tiny_nli,
    build_tiny_sentiment,
    run,
    serve,
)
from tests.tiny_encoders import build_tiny_splade
from tests.tiny_models import build_tiny_sentence_transformer

TEXTS = [
    "The cat sits on the mat.",
    "",
    "Grüße aus Köln: Straße, Äpfel und Öl. 東京は雨です。 Привет, мир! 🚀",
    "long " * 200,  # past every limit: truncated
    "A man is playing a guitar.",
    "Angela Merkel met Arnold Schwarzenegger in Köln.",
]
REPO = Path(__file__).resolve().parents[2]


def _items(texts: list[str]) -> list[dict[str, str]]:
    return [{"text": t} for t in texts]


@dataclass(frozen=True)
class Family:
    adapter: str
    build: Callable[[Path], Path]
    op: str
    requests: list[dict[str, Any]]
    entry: dict[str, Any] = field(default_factory=dict)
    folder: str = ""  # where the transformer sits inside the saved model

    @property
    def model_id(self) -> str:
        return f"test/onnx-{self.adapter}"


FAMILIES = {
    "dense-mean": Family("dense", lambda out: build_tiny_sentence_transformer(
        out, pooling="mean", normalize=True), "encode", [
            {"items": _items(TEXTS)},
            {"items": _items(TEXTS[:2]), "options": {"dimensions": 16, "normalize": True}},
            {"items": _items(TEXTS[:3]), "options": {"dtype": "float16"}}], {"dims": 32}),
    "dense-cls": Family("dense", lambda out: build_tiny_sentence_transformer(
        out, pooling="cls", normalize=False), "encode", [{"items": _items(TEXTS)}],
        {"dims": 32, "prompts": {"query": "query: "}}),
    "sparse": Family("sparse", build_tiny_splade, "encode", [{"items": _items(TEXTS)}]),
    "cross-encoder": Family("cross-encoder", build_tiny_cross_encoder, "score", [
        {"query": "who plays the guitar?", "items": _items(TEXTS)},
        {"query": "cats", "items": _items(TEXTS[:2]), "options": {"activation": "none"}}]),
    "sequence-classification": Family("sequence-classification", build_tiny_sentiment,
                                      "classify", [{"items": _items(TEXTS)}]),
    "zero-shot": Family("zero-shot", build_tiny_nli, "classify", [
        {"items": _items(TEXTS), "options": {"labels": ["music", "cats", "travel"]}}]),
    "ner-bert": Family("token-classification", build_tiny_ner, "extract", [
        {"items": _items(TEXTS), "options": {"aggregation": strategy}}
        for strategy in ("none", "simple", "first", "average", "max")]),
    "ner-xlm-roberta": Family("token-classification",
                              lambda out: build_tiny_ner(out, "xlm-roberta"), "extract", [
        {"items": _items(TEXTS), "options": {"aggregation": "simple"}}]),
}


@pytest.fixture(scope="module", autouse=True)
def onnx_cache(tmp_path_factory: pytest.TempPathFactory):
    patch = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("onnx-cache")
    patch.setenv("SHOAL_ONNX_CACHE", str(cache))
    yield cache
    patch.undo()


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A family, its model folder and its three hosts: PyTorch, ONNX fp32, ONNX int8."""
    family = FAMILIES[request.param]
    path = family.build(tmp_path_factory.mktemp("onnx") / request.param)
    for precision in ("fp32", "int8"):
        export_graph(path, family.adapter, precision)
    hosts = {name: serve(family.model_id, family.adapter, path, engine=engine,
                         precision=precision, **family.entry)
             for name, engine, precision in (("torch", "pytorch", None),
                                             ("fp32", "onnx", "fp32"),
                                             ("int8", "onnx", "int8"))}
    return family, path, hosts


def _answers(family: Family, host: ModelHost) -> list[dict[str, Any]]:
    outcomes = run(host, family.model_id, family.op, *family.requests)
    assert all(o.ok for o in outcomes), [o.error_message for o in outcomes]
    return [o.result for o in outcomes]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return (a * b).sum(axis=1)


def _vectors(result: dict[str, Any]) -> np.ndarray:
    """A result's rows as float32 (dense: its dtype's; sparse: over the vocabulary)."""
    if result["output"] == "sparse":
        rows = np.zeros((result["count"], result["vocab_size"]), dtype=np.float32)
        for row, vector in zip(rows, result["embeddings"], strict=True):
            row[vector["indices"]] = vector["values"]
        return rows
    dtype = {"float32": "<f4", "float16": "<f2"}[result["dtype"]]
    rows = np.frombuffer(result["embeddings"], dtype=dtype).astype(np.float32)
    return rows.reshape(result["count"], result["dims"])


def _scores(result: dict[str, Any]) -> np.ndarray:
    """Scores of a score or classify result (classify: by label name, per text)."""
    if "scores" in result:
        return np.array(result["scores"])
    return np.array([[s for _, s in sorted((e["label"], e["score"]) for e in labels)]
                     for labels in result["labels"]])


def _same(ours: dict[str, Any], theirs: dict[str, Any], min_cosine: float,
          score_tolerance: float) -> None:
    assert ours["usage"] == theirs["usage"]
    if "embeddings" in theirs:
        assert (ours.get("dims"), ours["count"]) == (theirs.get("dims"), theirs["count"])
        a, b = _vectors(ours), _vectors(theirs)
        assert _cosines(a, b).min() >= min_cosine
    elif "entities" in theirs:
        spans = [[(e["label"], e["start"], e["end"], e["text"]) for e in item]
                 for item in theirs["entities"]]
        assert [[(e["label"], e["start"], e["end"], e["text"]) for e in item]
                for item in ours["entities"]] == spans
        scores = [e["score"] for item in ours["entities"] for e in item]
        assert scores == pytest.approx([e["score"] for item in theirs["entities"]
                                        for e in item], abs=score_tolerance)
    else:
        if "labels" in theirs:  # the same labels in the same order
            assert [[e["label"] for e in row] for row in ours["labels"]] == \
                [[e["label"] for e in row] for row in theirs["labels"]]
        np.testing.assert_allclose(_scores(ours), _scores(theirs), atol=score_tolerance)


def test_fp32_answers_as_pytorch(served):
    family, _, hosts = served
    torch_answers = _answers(family, hosts["torch"])
    onnx_answers = _answers(family, hosts["fp32"])
    for ours, theirs in zip(onnx_answers, torch_answers, strict=True):
        _same(ours, theirs, min_cosine=0.9999, score_tolerance=1e-4)


def _best(result: dict[str, Any]) -> list[Any]:
    """The top answer per item: the best label, or (for scores) the ranking."""
    if "labels" in result:
        return [row[0]["label"] for row in result["labels"]]
    return list(np.argsort(result["scores"]))


def test_int8_answers_close_to_fp32(served):
    family, _, hosts = served
    if family.adapter == "token-classification":
        # Entities follow every token's tag: compare the tags.
        full, quantized = (hosts[name].adapter(family.model_id) for name in ("fp32", "int8"))
        ids = full.tokenizer([t for t in TEXTS if t], truncation=True,
                             max_length=full.max_length)["input_ids"]
        tags, quantized_tags = ([np.argmax(p, axis=1) for p in adapter.probabilities(ids, None)]
                                for adapter in (full, quantized))
        agree = np.mean(np.concatenate(tags) == np.concatenate(quantized_tags))
        assert agree >= 0.95, f"int8 tags {agree:.1%} of tokens as fp32 does"
        return
    full = _answers(family, hosts["fp32"])
    quantized = _answers(family, hosts["int8"])
    for ours, theirs in zip(quantized, full, strict=True):
        if "embeddings" in theirs:
            assert _cosines(_vectors(ours), _vectors(theirs)).min() >= 0.99
        else:
            assert _best(ours) == _best(theirs)


def _entry(model_id: str, path: Path, adapter: str = "dense") -> ModelEntry:
    return ModelEntry.model_validate({"id": model_id, "adapter": adapter, "dims": 32,
                                      "source": {"path": str(path)}})


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense model with its fp32 graph exported."""
    path = build_tiny_sentence_transformer(tmp_path_factory.mktemp("onnx") / "dense",
                                           pooling="mean", normalize=True, seed=3)
    export_graph(path, "dense", "fp32")
    return path


def test_serving_imports_no_torch(dense_path, onnx_cache):
    """A fresh interpreter, as the ONNX runtime process is: load, answer, no torch."""
    path = dense_path
    code = f"""
import json, sys
from runtimes.base import Request
from runtimes.base import LoadFailed, Request
from runtimes.child_side.host import ModelHost
from tasks.catalog import ModelEntry
host = ModelHost(engine="onnx")
entry = ModelEntry.model_validate({{"id": "m", "adapter": "dense", "dims": 32,
                                   "source": {{"path": {str(path)!r}}}}})
host.load_one(entry)
(outcome,) = host.run_batch("m", [Request("1", "encode", {{"items": [{{"text": "hi"}}]}})])
print(json.dumps({{"ok": outcome.ok, "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules}}))
"""
    env = {**os.environ, "SHOAL_ONNX_CACHE": str(onnx_cache)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == \
        {"ok": True, "torch": False, "transformers": False}


def test_a_missing_graph_is_exported_where_torch_is_installed(tmp_path):
    path = build_tiny_sentence_transformer(tmp_path / "fresh", pooling="mean",
                                           normalize=True, seed=7)
    host = ModelHost(engine="onnx")
    host.load_one(_entry("test/fresh", path))  # no export before: the load makes it
    graph = host.adapter("test/fresh").model.graph
    assert graph.is_file() and graph.parent.parent == Path(os.environ["SHOAL_ONNX_CACHE"])


def test_a_missing_graph_without_torch_names_the_command(tmp_path, onnx_cache):
    path = build_tiny_sentence_transformer(tmp_path / "unexported", pooling="mean",
                                           normalize=True, seed=8)
    # None in sys.modules is how Python marks a module as not importable.
    code = f"""
import sys
sys.modules["torch"] = None
from runtimes.base import LoadFailed, Request
from runtimes.child_side.host import ModelHost
from tasks.catalog import ModelEntry
entry = ModelEntry.model_validate({{"id": "test/unexported", "adapter": "dense", "dims": 32,
                                   "source": {{"path": {str(path)!r}}}}})
try:
    ModelHost(engine="onnx").load_one(entry)
except Exception as exc:
    print(type(exc).__name__, exc)
"""
    env = {**os.environ, "SHOAL_ONNX_CACHE": str(onnx_cache)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120, check=False)
    assert done.stdout.startswith(GraphMissing.__name__), done.stdout + done.stderr
    assert "shoal export test/unexported --precision fp32" in done.stdout


def test_a_corrupt_graph_fails_its_model_only(dense_path, tmp_path):
    path = dense_path
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    good_graph = export_graph(path, "dense", "fp32")
    (broken / "onnx").mkdir()
    (broken / "onnx" / "model.onnx").write_bytes(good_graph.read_bytes()[:4096])  # truncated
    host = ModelHost(engine="onnx")
    host.load_one(_entry("test/good", path))
    with pytest.raises(ValueError, match=r"cannot read .*shoal export test/broken"):
        host.load_one(_entry("test/broken", broken))
    (outcome,) = run(host, "test/good", "encode", {"items": _items(TEXTS[:2])})
    assert outcome.ok and host.adapter("test/broken") is None


def test_the_runtime_process_serves_on_onnx_and_survives_a_corrupt_graph(dense_path, tmp_path,
                                                                        onnx_cache):
    """The worker's runtime process on the ONNX engine: a model whose graph is corrupt
    fails its load with the reason, and the process keeps serving the others."""
    broken = tmp_path / "broken"
    shutil.copytree(dense_path, broken)
    (broken / "onnx").mkdir()
    (broken / "onnx" / "model.onnx").write_bytes(b"not a graph")
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    for name, path in (("good", dense_path), ("broken", broken)):
        (catalog / f"{name}.yaml").write_text(json.dumps(
            {"id": f"test/{name}", "adapter": "dense", "dims": 32, "runtime": "onnx",
             "source": {"path": str(path)}}))
    env = {"SHOAL_ONNX_CACHE": str(onnx_cache)}
    with ProcessRuntime(catalog, ["test/good"], threads=1, start_timeout=60, env=env,
                        engine="onnx") as runtime:
        pid = runtime.pid
        with pytest.raises(LoadFailed, match="cannot read"):
            runtime.load("test/broken")
        (outcome,) = runtime.run_batch("test/good", [
            Request("1", "encode", {"model": "test/good", "items": _items(TEXTS[:2])})])
        assert outcome.ok and runtime.pid == pid and "test/broken" not in runtime.resident
