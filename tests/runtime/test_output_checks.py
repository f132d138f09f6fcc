"""The runtime checks a request's output options once (issue 54): the entry's parse (the
adapter checks again only where its weights' width is not the entry's `dims`). What any
sender (a Celery client too) asks beyond the model is still refused with a clear
VALIDATION_ERROR, on either engine, and the batch's others run."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtimes.onnx.export import export_graph
from tests.tiny_classifiers import run, serve
from tests.tiny_models import build_tiny_sentence_transformer

MODEL = "test/output-checks"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 32-dim dense model, its fp32 graph exported (into a cache of its own)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("SHOAL_ONNX_CACHE", str(tmp_path_factory.mktemp("onnx-cache")))
    folder = build_tiny_sentence_transformer(tmp_path_factory.mktemp("checks") / "dense",
                                             pooling="mean", normalize=True, seed=5)
    export_graph(folder, "dense", "fp32")
    yield folder
    patch.undo()


@pytest.mark.parametrize("engine", ["pytorch", "onnx"])
def test_output_options_beyond_the_model_are_refused_once_checked(path, engine):
    host = serve(MODEL, "dense", path, engine=engine, dims=32)
    good, wide, sparse, short = run(
        host, MODEL, "encode",
        {"items": [{"text": "a"}]},
        {"items": [{"text": "b"}], "options": {"dimensions": 64}},
        {"items": [{"text": "c"}], "options": {"output": "sparse"}},
        {"items": [{"text": "d"}], "options": {"dimensions": 8}},
    )
    assert good.ok and good.result["dims"] == 32
    assert wide.error_code == "VALIDATION_ERROR" and "from 1 to 32" in wide.error_message
    assert sparse.error_code == "VALIDATION_ERROR" and "not sparse" in sparse.error_message
    assert short.ok and short.result["dims"] == 8
    assert good.result["batch"]["requests"] == 2  # the refused ones did not run
