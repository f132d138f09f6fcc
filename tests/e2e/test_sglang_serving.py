"""A model served on SGLang through the whole stack: gateway -> RabbitMQ -> worker (its
continuous path, `batching.feeder`) -> SGLang server, streams back as PROGRESS states.

One worker of its own serves a tiny random Llama (`runtime: sglang` in its catalog
entry) for this module; its SGLang server starts once (~30-60 s on this CPU). The
runtime's own behaviour (greedy = transformers, seeds, embeddings, poison) is
tests/sglang's; here: the worker hands requests over as they come and answers each
when it ends, streams and cancels through the broker, and survives its server.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import APIError

from tests.conftest import SGLANG_LLAMA, SGLANG_LLAMA_DIR, queue_name
from tests.stack import openai_client, start_metered_worker, wait_for
from tests.tiny_lm import build_tiny_llama

pytestmark = pytest.mark.e2e
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def sglang_worker(stack):
    from runtimes.sglang.server import missing_python_message, sglang_python

    if not sglang_python().exists():
        pytest.fail(missing_python_message(sglang_python()), pytrace=False)
    if not (SGLANG_LLAMA_DIR / "config.json").exists():
        build_tiny_llama(SGLANG_LLAMA_DIR, hidden_size=64)
    # The model is pinned: the worker consumes once its SGLang server is healthy.
    worker = start_metered_worker(stack.stack, "sglang", SGLANG_LLAMA,
                                  queue_name(SGLANG_LLAMA), 300)
    yield worker
    worker.process.stop()


def test_chat_streams_as_the_unstreamed_answer(stack, sglang_worker):
    messages = [{"role": "user", "content": "tell me about the sea"}]
    client = openai_client(stack.url)
    whole = client.chat.completions.create(model=SGLANG_LLAMA, messages=messages,
                                           max_tokens=16, **GREEDY)
    assert whole.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model=SGLANG_LLAMA, messages=messages, max_tokens=16, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


def test_a_prompt_over_the_context_is_400_before_it_reaches_sglang(stack, sglang_worker):
    body = {"model": SGLANG_LLAMA, "prompt": "word " * 200, "max_tokens": 200, "stream": True}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
    # OpenAI's status for it (shoal's native routes answer 413)
    assert r.status_code == 400 and r.json()["error"]["code"] == "INPUT_TOO_LONG"
    assert "context" in r.json()["error"]["message"]


def test_concurrent_streams_are_handed_over_and_all_answered(stack, sglang_worker):
    def one(i: int) -> str:
        stream = openai_client(stack.url).completions.create(
            model=SGLANG_LLAMA, prompt=f"story {i}", max_tokens=12, stream=True, **GREEDY)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    assert all(texts)
    wait_for(lambda: sglang_worker.metric("shoal_runtime_in_flight") == 0, 30,
             "every request to be answered")


def test_a_client_that_leaves_aborts_its_sglang_request(stack, sglang_worker):
    before = sglang_worker.metric("shoal_generations_cancelled_total")
    body = {"model": SGLANG_LLAMA, "prompt": "a long story", "max_tokens": 200, "stream": True,
            **GREEDY}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    wait_for(lambda: sglang_worker.metric("shoal_generations_cancelled_total") > before, 30,
             "the worker to abort the generation")
    wait_for(lambda: sglang_worker.metric("shoal_runtime_in_flight") == 0, 30,
             "the slot to be freed")


def test_an_sglang_server_killed_mid_stream_ends_that_stream(stack, sglang_worker):
    body = {"model": SGLANG_LLAMA, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 200, "stream": True, **GREEDY}
    chunks = openai_client(stack.url).chat.completions.create(**body)
    with pytest.raises(APIError) as raised:
        for i, _ in enumerate(chunks):
            if i == 1:
                os.kill(sglang_worker.child_pid(b"runtimes/sglang/launch.py"), signal.SIGKILL)
    assert "STREAM_INTERRUPTED" in str(raised.value.body)
    # The server restarts (tens of seconds); meanwhile requests wait within their deadline.
    again = openai_client(stack.url).with_options(timeout=300).chat.completions.create(
        **{**body, "max_tokens": 4, "stream": False}, extra_headers={"X-Timeout-Ms": "280000"})
    assert again.choices[0].finish_reason in ("stop", "length")
    assert sglang_worker.metric("shoal_runtime_restarts") >= 1
