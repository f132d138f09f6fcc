"""`shoal tune`'s engine choice (`app.onboard.engine_choice`) on a tiny encoder: each
engine's parity against sentence-transformers at onboarding's bound, its in-process
rate, and the fastest that holds the bound; an engine whose answers do not hold it is
not chosen."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.onboard.engine_choice import choose_engine
from app.tuning.mix import make_requests
from app.tuning.tune import calibrate
from runtimes.onnx.export import export_graph
from tasks.catalog import ModelEntry, Source
from tests.tiny_models import build_tiny_sentence_transformer


@pytest.fixture(scope="module")
def entry(tmp_path_factory: pytest.TempPathFactory) -> ModelEntry:
    patch = pytest.MonkeyPatch()
    patch.setenv("SHOAL_ONNX_CACHE", str(tmp_path_factory.mktemp("onnx-cache")))
    folder = build_tiny_sentence_transformer(tmp_path_factory.mktemp("tiny") / "st",
                                             pooling="mean", normalize=True, seed=11)
    yield ModelEntry.model_validate({"id": "test/choice", "adapter": "dense", "dims": 32,
                                     "source": {"path": str(folder)}})
    patch.undo()


REQUESTS = make_requests(64, "uniform:1:4", "uniform:5:15")


def _quick(entry, requests, engine, precision):
    return calibrate(entry, requests, sizes=(1, 8), reps=1, engine=engine, precision=precision)


def test_the_fastest_engine_that_holds_parity_is_chosen(entry: ModelEntry):
    best, trials = choose_engine(entry, REQUESTS, "cpu", _quick, say=lambda _: None)
    assert [(t.runtime, t.precision) for t in trials] == [("pytorch", "fp32"), ("onnx", "fp32")]
    assert all(t.parity_ok and t.figures["cosine_min"] >= 0.999 for t in trials)
    assert best is not None and best.tokens_per_s == max(t.tokens_per_s for t in trials)


def test_an_engine_off_the_bound_is_not_chosen(entry: ModelEntry, tmp_path: Path):
    """ONNX Runtime given another model's graph (shipped in the folder's onnx/, so used
    as is) runs, and fast, but its vectors fail the bound: PyTorch is chosen."""
    folder = Path(entry.source.path or "")
    other = build_tiny_sentence_transformer(tmp_path / "other", pooling="mean",
                                            normalize=True, seed=12)
    wrong = tmp_path / "wrong"
    shutil.copytree(folder, wrong)
    (wrong / "onnx").mkdir()
    shutil.copy(export_graph(other, "dense", "fp32"), wrong / "onnx" / "model.onnx")
    mislabelled = entry.model_copy(update={"source": Source(path=str(wrong))})
    best, trials = choose_engine(mislabelled, REQUESTS, "cpu", _quick, say=lambda _: None)
    assert best is not None and best.runtime == "pytorch"
    assert not trials[1].parity_ok and "parity failed" in trials[1].note
    assert trials[1].tokens_per_s == 0  # not even timed
