"""The session stack every e2e test shares (a worker and a gateway over the real RabbitMQ)
and the weights of the tiny models it serves; the names and settings are tests/conftest.py's."""

from __future__ import annotations

import os

import pytest

from app.tuning.stack import prefix_queues
from tests.conftest import (
    CLIP,
    COLBERT,
    DLQ,
    FAMILIES_WORKER,
    FAMILY_ADAPTERS,
    FAULTY,
    LLAMA,
    MAIN_WORKER,
    MINILM,
    NER,
    NLI,
    ONNX_MINILM,
    ONNX_NEIGHBOUR,
    PREFIX,
    RERANKER,
    RESTART,
    SENTIMENT,
    SGLANG_LLAMA,
    SPLADE,
    STREAM_LLAMA,
    TINY_CLS,
    TINY_CLS_DIR,
    UNSERVED,
    family_dir,
    queue_name,
)
from tests.stack import Stack, delete_queues, free_port, http_status, queue_counts, wait_for
from tests.tiny_models import build_tiny_sentence_transformer


@pytest.fixture(scope="session", autouse=True)
def tiny_cls_weights() -> None:
    """The weights the test catalog names for TINY_CLS, FAULTY and DLQ, built once."""
    build_tiny_sentence_transformer(TINY_CLS_DIR, pooling="cls", normalize=True)


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
                                     STREAM_LLAMA, SGLANG_LLAMA, ONNX_MINILM, ONNX_NEIGHBOUR,
                                     *FAMILY_ADAPTERS])
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
                                             ONNX_MINILM, ONNX_NEIGHBOUR, *FAMILY_ADAPTERS]))


@pytest.fixture(scope="session")
def families(stack: Live) -> Live:
    """A worker serving one tiny model of every adapter family, behind the session gateway."""
    _build_family_models()
    stack.stack.worker(FAMILIES_WORKER, list(FAMILY_ADAPTERS))
    for model in FAMILY_ADAPTERS:
        wait_for(lambda m=model: queue_counts(queue_name(m))[1] >= 1, 120,
                 f"a worker to consume {model}")
    return stack
