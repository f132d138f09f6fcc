"""LoRA adapters served end to end: a real worker loads each on its first request, into
the same memory budget as the models, and batches requests of different LoRAs together.

A tiny dense base model and three tiny random LoRAs made with peft at test time; each
answer through the stack must equal peft's merged model for its LoRA.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from sentence_transformers import SentenceTransformer

from tasks.pool_state import RESIDENT
from tests.stack import (
    free_port,
    http_status,
    metric_sum,
    private_stack,
    queue_counts,
    wait_for,
)
from tests.tiny_lora import BERT_TARGETS, build_tiny_lora, save_merged
from tests.tiny_models import build_tiny_sentence_transformer

pytestmark = pytest.mark.e2e
BASE = "test/lora-base"
LORAS = ("alpha", "beta", "gamma")
TEXTS = ["The cat sits on the mat.", "hello there", "rivers of france"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], Path]:
    root = tmp_path_factory.mktemp("lora-e2e")
    base = build_tiny_sentence_transformer(root / "base", pooling="mean", normalize=True)
    loras = {name: build_tiny_lora(base, root / f"lora-{name}", targets=BERT_TARGETS,
                                   seed=200 + i) for i, name in enumerate(LORAS)}
    catalog = root / "catalog"
    catalog.mkdir()
    (catalog / "base.yaml").write_text(yaml.safe_dump({
        "id": BASE, "adapter": "dense", "dims": 32, "source": {"path": str(base)},
        "loras": {name: {"path": str(path)} for name, path in loras.items()}}))
    return base, loras, catalog


def _expected(base: Path, lora: Path | None, out: Path) -> np.ndarray:
    """What sentence-transformers gives on the weights with the LoRA merged in."""
    weights = base if lora is None else save_merged(base, lora, out)
    return SentenceTransformer(str(weights), device="cpu").encode(TEXTS)


async def _encode_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(
            client.post(f"{url}/v1/encode/{BASE}", json=body,
                        headers={"x-timeout-ms": "120000"}) for body in bodies)))


def test_each_lora_answers_as_its_merged_model_and_they_share_batches(models, tmp_path):
    base, loras, catalog = models
    expected = {name: _expected(base, path, tmp_path / f"merged-{name}")
                for name, path in loras.items()}
    expected[None] = _expected(base, None, tmp_path)
    with private_stack(tmp_path, "lora-e2e", BASE) as private:
        env = {"SHOAL_QUEUE_PREFIX": private.prefix, "SHOAL_CATALOG_DIR": str(catalog),
               "SHOAL_WORKER_METRICS_PORT": "0", "SHOAL_TORCH_THREADS": "1",
               "SHOAL_POOL_STATE_INTERVAL_S": "1"}
        private.stack.worker(f"lora-{private.prefix}", [BASE], **env)
        private.stack.gateway("lora-e2e-gateway", private.port, [BASE], **env)
        wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 30, "the gateway")
        wait_for(lambda: queue_counts(private.queue)[1] >= 1, 120, "the worker",
                 give_up=private.stack.exited)

        # Every LoRA and the base model at once: the first requests start the loads,
        # and what waits for them batches together once they are in.
        names: list[str | None] = [*LORAS, None] * 2
        bodies = [{"items": [{"text": t} for t in TEXTS],
                   "options": {} if name is None else {"lora": name}} for name in names]
        answers = asyncio.run(_encode_all(private.url, bodies))
        for name, r in zip(names, answers, strict=True):
            assert r.status_code == 200, r.text
            got = np.array(r.json()["embeddings"], dtype=np.float32)
            want = expected[name]
            cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(
                want, axis=1)
            assert cosines.min() >= 0.9999, (name, cosines)
        # The LoRAs change the output (else this test proves nothing).
        assert min(np.abs(expected[n] - expected[None]).max() for n in LORAS) > 1e-3

        # Once loaded, requests of different LoRAs (one each) run in one batch.
        again = asyncio.run(_encode_all(private.url, bodies[:len(LORAS) + 1]))
        sizes = [int(r.headers["x-batch-requests"]) for r in again]
        assert max(sizes) > 1 and all(r.status_code == 200 for r in again), sizes

        # The worker reports its adapters; an unknown one is a 404 before any worker.
        rows = wait_for(lambda: [w for m in httpx.get(f"{private.url}/v1/models").json()[
            "data"] if m["id"] == BASE for w in m["workers"]
            if w["state"] == RESIDENT and set(w.get("loras") or []) == set(LORAS)], 20,
            "the worker to report its LoRAs")
        assert rows
        r = httpx.post(f"{private.url}/v1/encode/{BASE}",
                       json={"items": [{"text": "x"}], "options": {"lora": "nope"}})
        assert r.status_code == 404 and r.json()["error"]["code"] == "LORA_NOT_FOUND"


def test_a_request_waiting_for_its_lora_is_answered_at_its_deadline(tmp_path):
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    adapter = tmp_path / "adapter"  # the sim runtime never reads it
    adapter.mkdir()
    (catalog / "base.yaml").write_text(yaml.safe_dump({
        "id": BASE, "adapter": "dense", "dims": 32, "source": {"path": str(tmp_path)},
        "loras": {"slow": {"path": str(adapter)}}}))
    with private_stack(tmp_path, "lora-deadline", BASE) as private:
        # A device 250x slower: the pinned base is in at start, a LoRA takes 5 s.
        metrics_port = free_port()
        env = {"SHOAL_QUEUE_PREFIX": private.prefix, "SHOAL_CATALOG_DIR": str(catalog),
               "SHOAL_WORKER_METRICS_PORT": str(metrics_port), "SHOAL_RUNTIME": "sim",
               "SHOAL_SIM_SPEED": "0.004"}
        private.stack.worker(f"lora-deadline-{private.prefix}", [BASE], **env)
        private.stack.gateway("lora-deadline-gateway", private.port, [BASE], **env)
        wait_for(lambda: http_status(f"{private.url}/readyz") == 200, 30, "the gateway")
        wait_for(lambda: queue_counts(private.queue)[1] >= 1, 60, "the worker",
                 give_up=private.stack.exited)
        r = httpx.post(f"{private.url}/v1/encode/{BASE}", timeout=30,
                       json={"items": [{"text": "x"}], "options": {"lora": "slow"}},
                       headers={"x-timeout-ms": "1000"})
        assert r.status_code == 504, r.text
        # The worker answered it too, at its deadline, not 5 s later when the load ends
        # (the gateway's reply is its own timeout's: the two race).
        wait_for(lambda: metric_sum(f"http://127.0.0.1:{metrics_port}/metrics",
                                    "shoal_results_total") >= 1, 2.5,
                 "the worker to answer the parked request")
