"""MiniLM on ONNX Runtime through the whole stack: gateway -> RabbitMQ -> a worker whose
runtime router has an ONNX runtime process (`runtime: onnx` in the entry, and
SHOAL_RUNTIME=onnx) and a PyTorch one for the model ONNX does not serve (a causal LM).

The worker exports MiniLM's graph on its first load (torch is installed here; the
ONNX runtime process itself never imports it: tests/runtime/test_onnx.py). The
families' parity with PyTorch is tests/runtime/test_onnx.py's; here: the OpenAI client
gets PyTorch's vectors from the ONNX worker, the model beside it answers, and the
device-busy metric counts the ONNX runtime's work.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tests.conftest import MINILM, ONNX_MINILM, ONNX_NEIGHBOUR, ONNX_NEIGHBOUR_DIR, queue_name
from tests.stack import MeteredWorker, free_port, openai_client, queue_counts, wait_for
from tests.tiny_lm import build_tiny_llama

pytestmark = pytest.mark.e2e
TEXTS = ["The cat sits on the mat.", "A man is playing a guitar.",
         "Grüße aus Köln: Straße und Öl. 東京は雨です。"]


@pytest.fixture(scope="module")
def onnx_worker(stack):
    if not (ONNX_NEIGHBOUR_DIR / "config.json").exists():
        build_tiny_llama(ONNX_NEIGHBOUR_DIR)
    port = free_port()
    process = stack.stack.worker(f"onnx-{uuid.uuid4().hex[:6]}", [ONNX_MINILM, ONNX_NEIGHBOUR],
                                 SHOAL_RUNTIME="onnx", SHOAL_WORKER_METRICS_PORT=str(port))
    worker = MeteredWorker(process, port)
    for model in (ONNX_MINILM, ONNX_NEIGHBOUR):  # both pinned: consumed once loaded
        wait_for(lambda m=model: queue_counts(queue_name(m))[1] >= 1, 300,
                 f"the ONNX worker to consume {model}", give_up=lambda: not process.alive())
    yield worker
    worker.process.stop()


def test_onnx_minilm_answers_the_openai_client_as_pytorch_does(stack, onnx_worker):
    client = openai_client(stack.url)
    ours, theirs = (np.array([d.embedding for d in client.embeddings.create(
        model=model, input=TEXTS).data], dtype=np.float32) for model in (ONNX_MINILM, MINILM))
    assert ours.shape == theirs.shape == (len(TEXTS), 384)
    cosines = (ours * theirs).sum(axis=1) / np.linalg.norm(ours, axis=1) / \
        np.linalg.norm(theirs, axis=1)
    assert cosines.min() >= 0.9999


def test_the_pytorch_model_beside_it_answers(stack, onnx_worker):
    reply = openai_client(stack.url).chat.completions.create(
        model=ONNX_NEIGHBOUR, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        temperature=0)
    assert reply.usage.completion_tokens > 0


def test_the_device_busy_metric_counts_the_onnx_runtime(stack, onnx_worker):
    before = onnx_worker.metric("shoal_device_busy_seconds_total")
    client = openai_client(stack.url)
    for _ in range(3):
        client.embeddings.create(model=ONNX_MINILM, input=TEXTS * 8)
    wait_for(lambda: onnx_worker.metric("shoal_device_busy_seconds_total") > before, 30,
             "device busy time of the ONNX batches")
