"""The SGLang runtime against real SGLang servers (no mocks) and transformers on the same weights.

Crash tests run last: each costs a server restart (~30 s on this CPU).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtimes.base import CANCELLED, Delta, Outcome, Request
from tasks.results import embedding_rows
from tests.sglang.conftest import EMBED, LLAMA, POISON
from tests.stack import wait_for

PROMPTS = ["the cat sat on the mat", "hello",
           "a much longer prompt about the weather in paris and the rivers of france today"]


def rid() -> str:
    return uuid.uuid4().hex[:12]


def generate(runtime, items: list[dict[str, Any]], stream: bool = False,
             on_deltas=None, deadline_ms: float | None = None, **options: Any) -> Request:
    return Request(rid(), "generate", {"model": LLAMA, "items": items, "options": options},
                   stream=stream, deadline_ms=deadline_ms)


def run(runtime, request: Request, on_deltas=None, timeout: float = 120) -> Outcome:
    return runtime.submit(LLAMA, request, on_deltas).result(timeout)




@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(llama_dir), local_files_only=True)


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(llama_dir), local_files_only=True).eval()


def greedy(model: Any, ids: list[int], max_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                         dtype=torch.long), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers(runtime, tokenizer, reference) -> None:
    outcome = run(runtime, generate(runtime, [{"text": p} for p in PROMPTS], max_tokens=16,
                                    temperature=0))
    assert outcome.ok, outcome
    result = outcome.result
    assert result["model"] == LLAMA and result["batch"]["requests"] == 1
    for i, (prompt, choice) in enumerate(zip(PROMPTS, result["choices"], strict=True)):
        # BOS because this tokenizer adds one itself; never the [SEP] it appends.
        ids = [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
        expected = greedy(reference, ids, 16)
        assert choice["index"] == i
        assert choice["prompt_tokens"] == len(ids)
        assert choice["completion_tokens"] == len(expected)
        assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert choice["finish_reason"] == ("stop" if expected[-1] == tokenizer.sep_token_id
                                           else "length")
        latency = result["latency"][i]
        assert latency["ttft_ms"] > 0 and latency["itl_ms"] >= 0
    usage = result["usage"]
    assert usage["prompt_tokens"] == sum(c["prompt_tokens"] for c in result["choices"])
    assert usage["tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_template_applied(runtime, tokenizer, reference) -> None:
    messages = [{"role": "user", "content": "what is the capital of france"}]
    outcome = run(runtime, generate(runtime, [{"messages": messages}], max_tokens=8,
                                    temperature=0))
    assert outcome.ok, outcome
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    (choice,) = outcome.result["choices"]
    assert choice["prompt_tokens"] == len(ids)
    assert choice["text"] == tokenizer.decode(greedy(reference, ids, 8), skip_special_tokens=True)


def test_seeded_sampling_repeats(runtime) -> None:
    def sample(seed: int) -> list[str]:
        outcome = run(runtime, generate(runtime, [{"text": "hello"}, {"text": "hello"}],
                                        max_tokens=12, temperature=1.0, seed=seed))
        assert outcome.ok, outcome
        return [c["text"] for c in outcome.result["choices"]]

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other
    assert first[0] != first[1]  # items of one request draw differently


def test_stop_strings_and_length(runtime) -> None:
    plain = run(runtime, generate(runtime, [{"text": PROMPTS[0]}], max_tokens=12,
                                  temperature=0))
    (choice,) = plain.result["choices"]
    assert choice["finish_reason"] == "length" and choice["completion_tokens"] == 12
    words = choice["text"].split()
    stop = words[len(words) // 2]
    stopped = run(runtime, generate(runtime, [{"text": PROMPTS[0]}], max_tokens=12,
                                    temperature=0, stop=[stop]))
    (cut,) = stopped.result["choices"]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == choice["text"][:choice["text"].find(stop)]
    assert cut["completion_tokens"] < 12


def test_embeddings_match_pytorch_dense(runtime, llama_dir) -> None:
    from runtimes.pytorch.dense import DenseEncoder

    texts = ["the cat sat on the mat", "paris is in france", "hello"]
    outcome = runtime.submit(EMBED, Request(rid(), "encode", {"model": EMBED, "items": [
        {"text": t} for t in texts]})).result(60)
    assert outcome.ok, outcome
    assert outcome.result["dims"] == 64 and outcome.result["count"] == 3
    got = np.asarray(embedding_rows(outcome.result))
    encoder = DenseEncoder(str(llama_dir), pooling="lasttoken", normalize=True)
    want = encoder.encode(texts)
    cosine = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1)
                                         * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.999, cosine


def test_token_ids_run_as_their_text_does(runtime, tokenizer) -> None:
    """Token-id items reach SGLang as they are: a prompt's ids (BOS first, as this
    tokenizer's text prompts get it) complete as the text does, a text's ids
    (`tokenizer(text)["input_ids"]`) embed as the text does; an id outside the vocabulary
    fails its own request before SGLang sees it."""
    ids = [tokenizer.bos_token_id, *tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]]
    text, tokens = (run(runtime, generate(runtime, [item], max_tokens=8, temperature=0))
                    for item in ({"text": PROMPTS[0]}, {"tokens": ids}))
    assert text.ok and tokens.ok, (text, tokens)
    assert tokens.result["choices"] == text.result["choices"]
    embedded = [runtime.submit(EMBED, Request(rid(), "encode", {"model": EMBED, "items": [
        item]})).result(60) for item in ({"text": "hello"},
                                         {"tokens": tokenizer("hello")["input_ids"]})]
    assert all(o.ok for o in embedded), embedded
    np.testing.assert_allclose(*(np.asarray(embedding_rows(o.result)) for o in embedded),
                               atol=1e-5)
    bad = run(runtime, generate(runtime, [{"tokens": [1, len(tokenizer)]}], max_tokens=2))
    assert bad.error_code == "VALIDATION_ERROR" and "vocabulary" in bad.error_message


def test_streamed_deltas_make_the_final_text(runtime) -> None:
    deltas: list[Delta] = []
    request = generate(runtime, [{"text": p} for p in PROMPTS[:2]], stream=True,
                       max_tokens=20, temperature=0)
    outcome = run(runtime, request, deltas.extend)
    assert outcome.ok, outcome
    for choice in outcome.result["choices"]:
        mine = [d for d in deltas if d.index == choice["index"]]
        assert len(mine) > 1 and all(d.id == request.id for d in mine)
        assert "".join(d.text for d in mine) == choice["text"]
        assert mine[-1].tokens == choice["completion_tokens"]


def test_cancel_mid_stream_frees_the_slot(runtime) -> None:
    first = threading.Event()
    request = generate(runtime, [{"text": "hello"}], stream=True, max_tokens=240,
                       temperature=0)

    def on_deltas(deltas: list[Delta]) -> None:
        if not first.is_set():
            first.set()
            runtime.cancel([request.id])

    outcome = run(runtime, request, on_deltas)
    assert first.is_set()
    assert outcome.ok, outcome
    (choice,) = outcome.result["choices"]
    assert choice["finish_reason"] == CANCELLED
    assert choice["completion_tokens"] < 240
    wait_for(lambda: runtime.load_of(LLAMA).running == 0
               and runtime.load_of(LLAMA).waiting == 0, 30, "SGLang to free the slot")


def test_deadline_aborts(runtime) -> None:
    request = generate(runtime, [{"text": "hello"}], max_tokens=240, temperature=0,
                       deadline_ms=time.time() * 1000 + 150)
    outcome = run(runtime, request)
    assert outcome.error_code == "DEADLINE_EXCEEDED", outcome
    wait_for(lambda: runtime.load_of(LLAMA).running == 0, 30, "SGLang to free the slot")


def test_over_context_never_reaches_sglang(runtime) -> None:
    sent = runtime.requests_sent
    outcome = run(runtime, generate(runtime, [{"text": "word " * 300}], max_tokens=4))
    assert outcome.error_code == "INPUT_TOO_LONG", outcome
    fits_not = run(runtime, generate(runtime, [{"text": "hello"}], max_tokens=255))
    assert fits_not.error_code == "INPUT_TOO_LONG", fits_not
    assert runtime.requests_sent == sent


def test_server_killed_mid_stream(runtime) -> None:
    restarts = runtime.restarts
    first = threading.Event()
    quiet = runtime.submit(LLAMA, generate(runtime, [{"text": "hello"}], max_tokens=240,
                                           temperature=0))
    loud = runtime.submit(LLAMA, generate(runtime, [{"text": PROMPTS[0]}], stream=True,
                                          max_tokens=240, temperature=0),
                          lambda deltas: first.set())
    assert first.wait(60)
    os.kill(runtime.server_pids()[LLAMA], signal.SIGKILL)
    died = loud.result(120)
    assert died.error_code == "STREAM_INTERRUPTED"
    assert "the SGLang server died mid-generation" in died.error_message
    survived = quiet.result(240)
    assert survived.ok, survived
    assert survived.result["choices"][0]["completion_tokens"] > 0
    assert runtime.restarts == restarts + 1
    again = run(runtime, generate(runtime, [{"text": "hello"}], max_tokens=4, temperature=0))
    assert again.ok, again


def test_poison_prompt_is_isolated(runtime) -> None:
    poisoned = runtime.poison_isolated
    good = [runtime.submit(LLAMA, generate(runtime, [{"text": p}], max_tokens=30,
                                           temperature=0)) for p in PROMPTS[:2]]
    bad = runtime.submit(LLAMA, generate(runtime, [{"text": f"a {POISON} walks"}],
                                         max_tokens=8, temperature=0))
    outcome = bad.result(280)
    assert outcome.error_code == "POISON_INPUT", outcome
    for future in good:
        served = future.result(60)
        assert served.ok, served
    assert runtime.poison_isolated == poisoned + 1
    after = run(runtime, generate(runtime, [{"text": "hello"}], max_tokens=4, temperature=0))
    assert after.ok, after


WORKER = """
import sys, time
from runtimes.sglang import SGLangRuntime
rt = SGLangRuntime(sys.argv[1], [sys.argv[2]], start_timeout=240)
print("SERVER", rt.server_pids()[sys.argv[2]], flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_no_orphan_server_outlives_a_killed_worker(catalog_dir) -> None:
    import subprocess
    import sys

    from tests.stack import REPO

    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(catalog_dir), LLAMA],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = worker.stdout.readline()
        assert line.startswith("SERVER"), line
        server = int(line.split()[1])
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)

        def group_gone() -> bool:
            try:
                os.killpg(server, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(group_gone, 20, "the orphaned SGLang server's process group to exit")
    finally:
        if worker.poll() is None:
            worker.kill()



def test_a_port_taken_before_the_server_binds_it_is_left_for_another(runtime, monkeypatch
                                                                     ) -> None:
    # The race behind a restart that hung for minutes: `free_port` finds a port free,
    # another process binds it, and SGLang logs "address already in use" and stays up
    # without serving. Here the port is really taken, by a listening socket of this test.
    import socket

    import httpx

    from runtimes.sglang import server as server_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    real = server_module.free_port
    ports = iter([taken_port])
    monkeypatch.setattr(server_module, "free_port", lambda: next(ports, None) or real())
    try:
        server = runtime._start_server(runtime._models[EMBED])
    finally:
        taken.close()
    try:
        assert server.port != taken_port
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        server.stop()
