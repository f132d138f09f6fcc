"""Streamed generation through the real stack: gateway (SSE) -> RabbitMQ -> worker ->
PyTorch runtime, deltas back as Celery PROGRESS states.

A worker of its own serves a tiny random Llama (its metrics on a port, so tests see
cancellations); greedy decoding makes a streamed completion comparable with the same
request unstreamed. The last test kills that worker.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import orjson
import pytest
from openai import APIError

from tests.conftest import STREAM_LLAMA, STREAM_LLAMA_DIR, queue_name
from tests.stack import MeteredWorker, openai_client, start_metered_worker, wait_for
from tests.tiny_lm import build_tiny_llama

pytestmark = pytest.mark.e2e
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def streams(stack):
    if not (STREAM_LLAMA_DIR / "config.json").exists():
        build_tiny_llama(STREAM_LLAMA_DIR)
    worker = start_metered_worker(stack.stack, "streams", STREAM_LLAMA,
                                  queue_name(STREAM_LLAMA), 120,
                                  SHOAL_POOL_STATE_INTERVAL_S="0.5")
    yield worker
    if worker.process.alive():
        worker.process.stop()


def cancelled(worker: MeteredWorker) -> float:
    return worker.metric("shoal_generations_cancelled_total")


def test_the_openai_client_streams_chat_as_the_unstreamed_answer(stack, streams):
    messages = [{"role": "user", "content": "tell me about the sea"}]
    client = openai_client(stack.url)
    whole = client.chat.completions.create(model=STREAM_LLAMA, messages=messages,
                                           max_tokens=24, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=STREAM_LLAMA, messages=messages, max_tokens=24, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_each_prompt_by_its_index(stack, streams):
    prompts = ["once upon a time", "the cat"]
    client = openai_client(stack.url)
    whole = client.completions.create(model=STREAM_LLAMA, prompt=prompts, max_tokens=16,
                                      **GREEDY)
    texts = ["", ""]
    for chunk in client.completions.create(model=STREAM_LLAMA, prompt=prompts, max_tokens=16,
                                           stream=True, **GREEDY):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]


def test_server_sent_events_end_with_done(stack, streams):
    body = {"model": STREAM_LLAMA, "prompt": "hello", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_errors_before_the_first_token_are_http_statuses(stack, streams):
    body = {"model": STREAM_LLAMA, "prompt": "word " * 200, "max_tokens": 200, "stream": True}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
    # OpenAI's status for a prompt over the context (shoal's native routes: 413)
    assert r.status_code == 400 and r.json()["error"]["code"] == "INPUT_TOO_LONG"
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
        "model": STREAM_LLAMA, "prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]


def test_a_client_that_leaves_cancels_its_generation(stack, streams):
    before = cancelled(streams)
    body = {"model": STREAM_LLAMA, "prompt": "a long story", "max_tokens": 240, "stream": True,
            **GREEDY}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first token came; leave
    wait_for(lambda: cancelled(streams) > before, 30, "the worker to stop the generation")
    after = openai_client(stack.url).completions.create(model=STREAM_LLAMA, prompt="again",
                                                        max_tokens=4)
    assert after.usage.completion_tokens <= 4


def test_celery_clients_follow_and_revoke_streams(stack, streams):
    from tasks.client import generate, stream

    kwargs = {"model": STREAM_LLAMA, "items": [{"text": "the sea"}],
              "options": {"max_tokens": 12, **GREEDY}, "stream": True}
    result = generate.apply_async(kwargs=kwargs)
    deltas = list(stream(result, timeout=60))
    final = result.get(timeout=10)
    assert "".join(d["text"] for d in deltas) == final["choices"][0]["text"]
    assert [d["tokens"] for d in deltas] == sorted(d["tokens"] for d in deltas)

    long = generate.apply_async(kwargs={**kwargs, "options": {"max_tokens": 240, **GREEDY}})
    for _ in stream(long, timeout=60):
        long.revoke()
        break  # waits for the result, which comes at the next token
    revoked = long.get(timeout=10)
    assert revoked["choices"][0]["finish_reason"] == "cancelled"
    assert revoked["choices"][0]["completion_tokens"] < 240


def test_a_runtime_killed_mid_stream_ends_that_stream_with_an_error(stack, streams):
    body = {"model": STREAM_LLAMA, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 240, "stream": True, **GREEDY}
    chunks = openai_client(stack.url).chat.completions.create(**body)
    with pytest.raises(APIError) as raised:
        for i, _ in enumerate(chunks):
            if i == 1:
                os.kill(streams.child_pid(b"runtimes.child_side.server"), signal.SIGKILL)
    assert "STREAM_INTERRUPTED" in str(raised.value.body) or \
        "interrupted" in str(raised.value).lower()
    # The runtime restarts; the next stream completes.
    again = list(openai_client(stack.url).chat.completions.create(**{**body, "max_tokens": 4}))
    assert again[-1].choices[0].finish_reason in ("stop", "length")


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error(stack, streams):
    """Not a hang: the gateway sees the worker's pool state go stale and ends the stream."""
    body = {"model": STREAM_LLAMA, "prompt": "and then", "max_tokens": 240, "stream": True,
            **GREEDY}
    events: list[str] = []
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60,
                      headers={"X-Timeout-Ms": "60000"}) as r:
        for line in r.iter_lines():
            if line:
                events.append(line)
            if len(events) == 2:
                threading.Thread(target=streams.process.kill).start()
    errors = [orjson.loads(e.removeprefix("data: ")) for e in events
              if e.startswith("data: {\"error\"")]
    assert errors and errors[-1]["error"]["code"] == "STREAM_INTERRUPTED", events[-3:]
