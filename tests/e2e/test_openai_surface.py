"""The OpenAI surface through the official `openai` SDK against the session stack: 2,048
inputs in one request, errors raised as the SDK's own exception classes, models listed and
retrieved by ids with "/", and the deadline header sent as a client default.

The SDK's retries are exercised where their outcome is known: a 503 it may retry
(tests/e2e/test_gateway_models.py) and a 504 it must not (tests/e2e/test_admission.py).
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import MINILM, TINY_CLS
from tests.stack import wait_for

pytestmark = pytest.mark.e2e

MAX_INPUTS = 2048  # OpenAI's limit, shoal's default SHOAL_MAX_ITEMS
SAMPLED = (0, 1, 777, 1500, MAX_INPUTS - 1)


def _client(stack, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", **kwargs)


def test_2048_inputs_give_2048_vectors_in_order(stack):
    # Short, distinct texts on the tiny model: the worker runs them in cost-bounded parts.
    texts = [f"text number {i}" for i in range(MAX_INPUTS)]
    client = _client(stack, default_headers={"X-Timeout-Ms": "120000"})
    out = client.embeddings.create(model=TINY_CLS, input=texts)
    assert [d.index for d in out.data] == list(range(MAX_INPUTS))
    vectors = np.array([d.embedding for d in out.data], dtype=np.float32)
    assert vectors.shape == (MAX_INPUTS, 32)
    assert len({row.tobytes() for row in vectors}) == MAX_INPUTS  # one per text
    for i in SAMPLED:
        alone = np.array(client.embeddings.create(model=TINY_CLS, input=texts[i])
                         .data[0].embedding, dtype=np.float32)
        assert float(alone @ vectors[i]) / float(np.linalg.norm(alone)
                                                 * np.linalg.norm(vectors[i])) >= 0.99999, i
    # The native route takes as many, with the same vectors.
    r = httpx.post(f"{stack.url}/v1/encode/{TINY_CLS}",
                   json={"items": [{"text": t} for t in texts]},
                   headers={"X-Timeout-Ms": "120000"}, timeout=150)
    assert r.status_code == 200, r.text
    native = np.array(r.json()["embeddings"], dtype=np.float32)
    assert native.shape == (MAX_INPUTS, 32)
    np.testing.assert_allclose(native[list(SAMPLED)], vectors[list(SAMPLED)], atol=1e-5)


def test_one_input_over_the_limit_is_a_bad_request(stack):
    with pytest.raises(openai.BadRequestError) as caught:
        _client(stack, max_retries=0).embeddings.create(model=TINY_CLS,
                                                        input=["x"] * (MAX_INPUTS + 1))
    error = caught.value.body
    assert error["code"] == "PAYLOAD_TOO_LARGE" and error["param"] == "input", error
    assert error["type"] == "invalid_request_error" and "2048" in error["message"]


def test_errors_are_the_sdk_s_own_exception_classes(stack):
    client = _client(stack, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:  # shoal's native routes: 422
        client.embeddings.create(model=MINILM, input="x", dimensions=0)
    assert caught.value.body["code"] == "VALIDATION_ERROR"
    assert caught.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="no/such-model", input="x")
    assert caught.value.body["code"] == "MODEL_NOT_FOUND"
    assert caught.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MINILM, messages=[{"role": "user",
                                                                "content": "x"}])
    assert caught.value.body["code"] == "UNSUPPORTED_OPERATION"


def test_models_are_listed_and_retrieved_by_ids_with_slashes(stack):
    client = _client(stack, max_retries=0)
    # Listed once the worker's pool state says it serves them (every few seconds).
    wait_for(lambda: {MINILM, TINY_CLS} <= {m.id for m in client.models.list()}, 30,
             "the worker's pool state")
    listed = {m.id: m for m in client.models.list()}
    everything = {m.id for m in client.models.list(extra_query={"all": "true"})}
    assert set(listed) < everything  # the gateway accepts models no worker serves
    got = client.models.retrieve(MINILM)  # sent as /v1/models/sentence-transformers%2F...
    assert got.id == MINILM and got.object == "model"
    assert isinstance(got.created, int) and got.created == listed[MINILM].created
    # shoal's own fields too (`workers` changes with every pool state: not compared)
    assert got.model_extra["dims"] == 384 and got.model_extra["tasks"] == ["encode"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("sentence-transformers/no-such-model")
