"""The packaged MiniLM through the worker's default path on a CPU: no SHOAL_RUNTIME, no
`runtime:` in its entry, so its cpu profile's engine (ONNX Runtime fp32) serves it. The
vectors hold onboarding's parity bound against PyTorch's; the graph is exported into
SHOAL_ONNX_CACHE by the first start and reused, not remade, by the next one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.onboard.parity.tolerances import tolerance_of
from app.worker.runtime import start_runtime, worker_runtime
from runtimes.base import Request
from runtimes.pytorch.dense import DenseEncoder
from tasks.catalog import load_catalog
from tasks.settings import Settings
from tests.tiny_models import MINILM_DIR

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TEXTS = ["The cat sits on the mat.", "", "A man is playing a guitar.",
         "Grüße aus Köln: Straße, Äpfel und Öl. 東京は雨です。", "long " * 300]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """An empty export cache of this module's own, and a worker's settings with no
    SHOAL_RUNTIME (the default path)."""
    patch = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("onnx-cache")
    patch.setenv("SHOAL_ONNX_CACHE", str(root))
    patch.delenv("SHOAL_RUNTIME", raising=False)
    patch.delenv("SHOAL_PRECISION", raising=False)
    yield root
    patch.undo()


def _serve_once(settings: Settings) -> np.ndarray:
    entries = [load_catalog(settings.catalog_dir).get(MINILM)]
    runtime = start_runtime(entries, {MINILM}, settings, chunk_tokens=4096)
    try:
        (outcome,) = runtime.run_batch(MINILM, [Request("1", "encode", {
            "model": MINILM, "items": [{"text": t} for t in TEXTS]})])
    finally:
        runtime.close()
    assert outcome.ok, outcome.error_message
    rows = np.frombuffer(outcome.result["embeddings"], "<f4")
    return rows.reshape(outcome.result["count"], outcome.result["dims"])


def _graphs(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*.onnx")}


def test_the_default_path_serves_onnx_vectors_within_the_parity_bound(cache: Path):
    settings = Settings()
    assert worker_runtime(settings) is None
    got = _serve_once(settings)
    # Only ONNX Runtime writes a graph into the cache: it served the model.
    (graph, exported) = next(iter(_graphs(cache).items()))
    assert graph.name == "fp32.onnx"
    want = DenseEncoder(str(MINILM_DIR)).encode(TEXTS)
    cosines = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) *
                                          np.linalg.norm(want, axis=1))
    op, bound = tolerance_of("dense", "fp32")["cosine_min"]
    assert op == ">=" and cosines.min() >= bound, cosines
    norms = np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert np.abs(norms - 1).max() <= tolerance_of("dense", "fp32")["norm_max_rel_diff"][1]

    # A second start finds the graph in the cache: nothing is exported again.
    again = _serve_once(Settings())
    assert _graphs(cache) == {graph: exported}
    np.testing.assert_allclose(again, got, atol=1e-6)
