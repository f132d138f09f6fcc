"""An onboarded entry serves: gateway -> RabbitMQ -> worker answers what the model's own
library computes (tiny models saved by sentence-transformers, onboarded with no hints);
and onboarding with tuning writes a profile the catalog accepts, from live sweeps."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from app.onboard.onboard import onboard
from tasks.catalog import load_entry
from tests.stack import http_status, private_stack, queue_counts, wait_for
from tests.tiny_onboard import build_st_cross_encoder, build_st_dense

pytestmark = pytest.mark.e2e

TEXTS = ["a short one", "Ein etwas längerer deutscher Satz über das Wetter.", "🙂 emoji"]
PROMPTS = {"query": "query: ", "document": "passage: "}


def quiet(_: str) -> None:
    pass


def test_onboarded_entries_serve_what_their_library_computes(tmp_path: Path):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    catalog = tmp_path / "catalog"
    dense_dir = build_st_dense(tmp_path / "embedder", "mean", True, prompts=PROMPTS)
    scorer_dir = build_st_cross_encoder(tmp_path / "reranker")
    embedder = onboard(str(dense_dir), catalog, tune_it=False, say=quiet).report.model
    reranker = onboard(str(scorer_dir), catalog, tune_it=False, say=quiet).report.model
    models = [embedder, reranker]
    with private_stack(tmp_path, "onboard", embedder) as private:
        env = {"SHOAL_QUEUE_PREFIX": private.prefix, "SHOAL_CATALOG_DIR": str(catalog),
               "SHOAL_WORKER_METRICS_PORT": "0", "SHOAL_TORCH_THREADS": "1"}
        private.stack.worker(f"onboard-{private.prefix}", models, **env)
        private.stack.gateway("onboard-gateway", private.port, models, **env)
        wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 30, "the gateway")
        wait_for(lambda: queue_counts(private.queue)[1] >= 1, 120, "the worker",
                 give_up=private.stack.exited)

        r = httpx.post(f"{private.url}/v1/encode/{embedder}", timeout=60, json={
            "items": [{"text": t} for t in TEXTS], "options": {"is_query": True}})
        assert r.status_code == 200, r.text
        got = np.array(r.json()["embeddings"], dtype=np.float32)
        want = SentenceTransformer(str(dense_dir), device="cpu").encode(
            TEXTS, prompt=PROMPTS["query"])
        cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cosines.min() >= 0.9999, cosines

        r = httpx.post(f"{private.url}/v1/score/{reranker}", timeout=60, json={
            "query": "what is the weather", "items": [{"text": t} for t in TEXTS]})
        assert r.status_code == 200, r.text
        scores = {hit["index"]: hit["score"] for hit in r.json()["results"]}
        want_scores = CrossEncoder(str(scorer_dir), device="cpu").predict(
            [("what is the weather", t) for t in TEXTS])
        assert np.allclose([scores[i] for i in range(len(TEXTS))], want_scores, atol=1e-4)


def test_onboarding_tunes_and_writes_a_profile(tmp_path: Path):
    folder = build_st_dense(tmp_path / "embedder", "cls", True)
    catalog = tmp_path / "catalog"
    outcome = onboard(str(folder), catalog, tune_it=True, duration=0.5, search=False,
                      say=quiet)
    assert outcome.report.status == "tuned", outcome.report
    chosen = outcome.report.chosen
    assert chosen is not None and chosen.parity_ok and chosen.knee_throughput
    assert chosen.curve, "the chosen candidate's sweep is kept for the report"
    entry = load_entry(outcome.path)
    profile = entry.profile("cpu")
    assert profile is not None and profile.precision == chosen.precision
    assert "shoal onboard" in profile.measured and "parity" in profile.measured
    # The engine is the device's choice, in its profile; the entry names none.
    data = yaml.safe_load(outcome.path.read_text())
    assert profile.runtime == chosen.runtime and "runtime" not in data
    # Every candidate the device offers was tried: parity at its precision, then a
    # sweep, or a note saying why not.
    assert {(c.runtime, c.precision) for c in outcome.report.candidates} >= {
        ("pytorch", "fp32"), ("onnx", "int8")}
    assert all(c.knee_throughput or c.note for c in outcome.report.candidates)
