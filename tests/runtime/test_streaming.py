"""Streamed generation in the PyTorch runtime: deltas add up to the final text, a cancel
stops a row at its next step, and a runtime that dies mid-stream interrupts only the
streams that had begun (the rest of the batch runs again).

A tiny random Llama decodes for as long as max_tokens allows (its EOS is rare), so a
stream is long enough to act on while it runs.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtimes.base import CANCELLED, Delta, Outcome, Request
from runtimes.child_side.host import ModelHost
from runtimes.families.deltas import held_back
from runtimes.worker_side.process import ProcessRuntime
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode
from tests.tiny_lm import build_tiny_llama

LLAMA = "test/tiny-llama"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("stream-lm") / "llama")


@pytest.fixture(scope="module")
def host(llama_dir: Path) -> ModelHost:
    host = ModelHost(threads=1)
    host.load([ModelEntry.model_validate({"id": LLAMA, "adapter": "causal-lm",
                                          "source": {"path": str(llama_dir)}})])
    return host


@pytest.fixture(scope="module")
def runtime(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    catalog = tmp_path_factory.mktemp("stream-catalog")
    (catalog / "llama.yaml").write_text(yaml.safe_dump(
        {"id": LLAMA, "adapter": "causal-lm", "source": {"path": str(llama_dir)}}))
    with ProcessRuntime(catalog, [LLAMA], threads=1, start_timeout=120) as runtime:
        yield runtime


def generate(request_id: str, *prompts: str, stream: bool = True, **options: Any) -> Request:
    kwargs = {"items": [{"text": p} for p in prompts],
              "options": {"max_tokens": 24, "temperature": 0, **options}}
    return Request(request_id, "generate", kwargs, stream=stream)


class Collected:
    """The deltas a batch sent, by (request id, item)."""

    def __init__(self) -> None:
        self.deltas: list[Delta] = []
        self.first = threading.Event()

    def __call__(self, deltas: list[Delta]) -> None:
        self.deltas.extend(deltas)
        self.first.set()

    def text(self, request_id: str, index: int = 0) -> str:
        return "".join(d.text for d in self.deltas if d.id == request_id and d.index == index)


def choices(outcome: Outcome) -> list[dict[str, Any]]:
    assert outcome.ok, outcome
    assert outcome.result is not None
    return outcome.result["choices"]


@pytest.mark.parametrize("stop", [(), ("e",), ("the ", "##")])
def test_deltas_add_up_to_the_completion(host, stop):
    plain = host.run_batch(LLAMA, [generate("p", "the cat sat", "hello", stream=False,
                                            stop=list(stop))])
    collected = Collected()
    streamed = host.run_batch(LLAMA, [generate("s", "the cat sat", "hello", stop=list(stop)),
                                      generate("q", "not streamed", stream=False)], collected)
    for index, (want, got) in enumerate(zip(choices(plain[0]), choices(streamed[0]),
                                            strict=True)):
        assert got["text"] == want["text"]
        assert collected.text("s", index) == want["text"]
        tokens = [d.tokens for d in collected.deltas if d.id == "s" and d.index == index]
        assert tokens == sorted(tokens) and tokens[-1] <= want["completion_tokens"]
    assert not any(d.id == "q" for d in collected.deltas), "an unstreamed request streamed"


def test_every_choice_reports_its_latencies(host):
    (outcome,) = host.run_batch(LLAMA, [generate("t", "hello", "hi", stream=False)])
    assert outcome.result is not None
    latency = outcome.result["latency"]
    assert len(latency) == 2 and all(t["ttft_ms"] > 0 and t["itl_ms"] > 0 for t in latency)


def test_a_cancelled_request_stops_at_its_next_step(host):
    def cancel_after_first(deltas: list[Delta]) -> None:
        host.cancel(["c"])

    outcomes = host.run_batch(LLAMA, [generate("c", "hello", max_tokens=64),
                                      generate("k", "hello", max_tokens=16, stream=False)],
                              cancel_after_first)
    (cancelled,) = choices(outcomes[0])
    (kept,) = choices(outcomes[1])
    assert cancelled["finish_reason"] == CANCELLED
    assert cancelled["completion_tokens"] < 64
    assert kept["finish_reason"] == "length" and kept["completion_tokens"] == 16


@pytest.mark.parametrize(("text", "stops", "held"), [
    ("abc", (), 0), ("ab\ufffd", (), 1), ("the en", ("end",), 2), ("the end", ("end",), 0),
    ("x\n", ("\n\n", "zz"), 1), ("xz\ufffd", ("zz",), 2),
])
def test_held_back_keeps_what_may_still_change(text, stops, held):
    assert held_back(text, stops) == held


def test_the_process_runtime_streams_and_cancels(runtime):
    collected = Collected()
    done: list[list[Outcome]] = []
    thread = threading.Thread(target=lambda: done.append(runtime.run_batch(
        LLAMA, [generate("a", "the cat", max_tokens=200)], collected)))
    thread.start()
    assert collected.first.wait(60), "no delta came"
    runtime.cancel(["a"])
    thread.join(60)
    assert done, "run_batch did not return after the cancel"
    (choice,) = choices(done[0][0])
    assert choice["finish_reason"] == CANCELLED and choice["completion_tokens"] < 200
    assert collected.text("a") == choice["text"][:len(collected.text("a"))]


def test_a_runtime_killed_mid_stream_interrupts_only_that_stream(runtime):
    pid = runtime.pid
    assert pid is not None
    killed = threading.Event()

    def kill_on_first(deltas: list[Delta]) -> None:
        if not killed.is_set():
            killed.set()
            os.kill(pid, signal.SIGKILL)

    outcomes = runtime.run_batch(LLAMA, [generate("s", "the cat", max_tokens=200),
                                         generate("n", "hello", stream=False, max_tokens=8)],
                                 kill_on_first)
    assert killed.is_set()
    assert outcomes[0].error_code == ErrorCode.STREAM_INTERRUPTED, outcomes[0]
    assert "part of this request's output was streamed" in (outcomes[0].error_message or "")
    (choice,) = choices(outcomes[1])
    assert choice["completion_tokens"] == 8
    assert runtime.pid != pid


def test_a_stream_behind_a_batch_in_flight_streams_and_its_cancel_lands(runtime):
    """Two batches in flight (the worker's default depth 2): a plain batch goes through the
    runtime's pipeline, a streamed one behind it waits until the pipeline is empty, then
    talks back and forth alone; cancelling it (the second batch) stops it, and both are
    answered."""
    collected = Collected()
    done: dict[str, list[Outcome]] = {}
    plain = threading.Thread(target=lambda: done.__setitem__("plain", runtime.run_batch(
        LLAMA, [generate("p", "the dog", max_tokens=48, stream=False)])))
    streamed = threading.Thread(target=lambda: done.__setitem__("stream", runtime.run_batch(
        LLAMA, [generate("s2", "the cat", max_tokens=200)], collected)))
    plain.start()
    streamed.start()
    assert collected.first.wait(60), "no delta came"
    runtime.cancel(["s2"])
    for thread in (plain, streamed):
        thread.join(60)
    assert set(done) == {"plain", "stream"}, "a batch was not answered"
    (kept,) = choices(done["plain"][0])
    assert kept["finish_reason"] == "length" and kept["completion_tokens"] == 48
    (cancelled,) = choices(done["stream"][0])
    assert cancelled["finish_reason"] == CANCELLED and cancelled["completion_tokens"] < 200
    assert collected.text("s2") == cancelled["text"][:len(collected.text("s2"))]
