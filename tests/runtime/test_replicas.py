"""Several runtime processes on one device (`runtimes.worker_side.replicas.ReplicaSet`): batches
spread
over them, and everything one runtime promises holds with several: a kill or a poison
request on one loses nothing and blames only the poison, cancels reach the replica that
runs the request, loads and LoRAs are on every replica and counted once per copy.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from batching.pool import lora_key
from runtimes.base import CANCELLED, DEVICE_GROUP_ENV, LoadFailed, Outcome, Request
from runtimes.child_side.host import ModelHost
from runtimes.worker_side.process import ProcessRuntime
from runtimes.worker_side.replicas import ReplicaSet, default_replicas
from tasks.catalog import Catalog
from tests.runtime.test_pipeline import InFlight, requests, vectors, wait_for
from tests.tiny_lm import build_tiny_llama
from tests.tiny_lora import BERT_TARGETS, build_tiny_lora
from tests.tiny_models import build_tiny_sentence_transformer

TINY, FAULTY, LLAMA = "test/tiny", "test/faulty", "test/tiny-llama"
SLOW_S = 2.0
CHILD_ENV = {"SHOAL_ALLOW_TEST_ADAPTERS": "1", "SHOAL_FAULTY_SLOW_S": str(SLOW_S)}


@pytest.fixture(scope="module")
def catalog_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("replicas")
    weights = build_tiny_sentence_transformer(root / "tiny", pooling="mean", normalize=True)
    lora = build_tiny_lora(weights, root / "tiny-lora", targets=BERT_TARGETS, seed=7)
    llama = build_tiny_llama(root / "llama")
    directory = root / "catalog"
    directory.mkdir()
    for name, model_id, adapter in (("tiny", TINY, "dense"), ("faulty", FAULTY, "dense-faulty")):
        entry = {"id": model_id, "adapter": adapter, "source": {"path": str(weights)},
                 "dims": 32}
        if adapter == "dense":
            entry["loras"] = {"lora-a": {"path": str(lora)}}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(entry))
    (directory / "llama.yaml").write_text(yaml.safe_dump(
        {"id": LLAMA, "adapter": "causal-lm", "source": {"path": str(llama)}}))
    return directory


def replica_set(catalog_dir: Path, models: list[str], count: int = 2) -> ReplicaSet:
    def start(index: int, env: dict[str, str]) -> ProcessRuntime:
        return ProcessRuntime(catalog_dir, models, threads=1, start_timeout=120,
                              env={**CHILD_ENV, **env}, pipeline_depth=2)

    return ReplicaSet(start, count)


@pytest.fixture(scope="module")
def replicas(catalog_dir: Path):
    runtime = replica_set(catalog_dir, [TINY, FAULTY])
    yield runtime
    runtime.close()


def sent(replica: ProcessRuntime) -> int:
    child = replica._child
    return 0 if child is None else child.turns.sent


def assert_all_ok_but(outcomes: list[Outcome], bad: int | None) -> None:
    for i, outcome in enumerate(outcomes):
        assert outcome.ok == (i != bad), (i, outcome.error_code, outcome.error_message)
        if i != bad:
            assert vectors(outcome).shape == (2, 32)


def test_auto_is_one_replica_on_a_cpu_and_a_share_of_the_cores_on_a_gpu():
    assert default_replicas("cpu", cores=64) == 1
    assert default_replicas("cuda", cores=16) == 4
    assert default_replicas("cuda:1", cores=2) == 1
    assert default_replicas("cuda", cores=128) == 8


def test_a_set_is_several_processes_with_the_same_results_as_in_process(replicas,
                                                                        catalog_dir):
    pids = replicas.pids
    assert len(set(pids)) == 2 and None not in pids
    assert replicas.capabilities.pipeline_depth == 4
    batch = requests("r", ["The cat sits on the mat.", "Grüße aus Köln 🚀", "word " * 300])
    host = ModelHost(threads=1)
    host.load(Catalog.from_dir(catalog_dir).require([TINY]))
    local = host.run_batch(TINY, batch)
    for remote, want in zip(replicas.run_batch(TINY, batch), local, strict=True):
        np.testing.assert_allclose(vectors(remote), vectors(want), rtol=1e-5, atol=1e-6)


def test_a_batch_goes_to_the_replica_with_the_least_in_flight(replicas):
    """While one replica computes a slow batch, the next batch goes to the other."""
    before = list(replicas.batches)
    flight = InFlight(replicas)
    flight.start("slow", FAULTY, requests("a", ["@@slow@@"]))
    wait_for(lambda: any(replicas._in_flight))
    flight.start("fast", TINY, requests("b", ["quick"]))
    outcomes = flight.join()
    assert [b - a for a, b in zip(before, replicas.batches, strict=True)] == [1, 1]
    assert_all_ok_but(outcomes["slow"], bad=None)
    assert_all_ok_but(outcomes["fast"], bad=None)


def test_a_frame_sent_ahead_through_the_set_runs_on_its_replica_with_the_same_results(
        replicas):
    """`ReplicaSet.send_ahead`: the lone batch's frame goes to the least busy replica now,
    and its batch runs there; a discarded one leaves every replica serving."""
    assert replicas.capabilities.send_ahead and replicas.capabilities.parallel == 2
    batch = requests("s", ["The cat sits on the mat.", "word " * 40])
    usual = replicas.run_batch(TINY, batch)
    sent_before = [sent(r) for r in replicas.replicas]
    ahead = replicas.send_ahead(TINY, batch)
    assert ahead is not None
    went_to = [sent(r) - b for r, b in zip(replicas.replicas, sent_before, strict=True)]
    assert sorted(went_to) == [0, 1]  # one frame, on one replica's connection, already
    for a, b in zip(replicas.run_batch(TINY, batch, ahead=ahead), usual, strict=True):
        np.testing.assert_allclose(vectors(a), vectors(b), rtol=1e-5, atol=1e-6)
    assert [sent(r) - b for r, b in zip(replicas.replicas, sent_before, strict=True)] == \
        went_to  # it ran on that frame: nothing sent again
    discarded = replicas.send_ahead(TINY, batch)
    assert discarded is not None
    discarded.discard()
    assert replicas._in_flight == [0, 0]
    for _ in range(2):  # the replica of the discarded frame serves on (its next frame too)
        assert_all_ok_but(replicas.run_batch(TINY, batch), bad=None)


def test_a_replica_killed_mid_batch_loses_nothing_and_the_others_serve_on(replicas):
    """SIGKILL of one replica with batches in flight on both: every request answered once,
    nobody blamed, only that replica restarted."""
    victim, other = replicas.replicas
    victim_pid, other_pid = victim.pid, other.pid
    restarts, poison = replicas.restarts, replicas.poison_isolated
    already = sent(victim)
    flight = InFlight(replicas)
    names = [f"b{k}" for k in range(4)]
    for k, name in enumerate(names):
        texts = [f"{name} text {i}" for i in range(3)] + (["@@slow@@"] if k < 2 else [])
        flight.start(name, FAULTY, requests(name, texts))
    wait_for(lambda: sent(victim) > already)  # a batch is on the victim's connection
    assert victim_pid is not None
    os.kill(victim_pid, signal.SIGKILL)
    outcomes = flight.join()
    assert sorted(outcomes) == names
    for name in names:
        assert_all_ok_but(outcomes[name], bad=None)
        assert [o.id for o in outcomes[name]] == [f"{name}{i}" for i in
                                                   range(len(outcomes[name]))]
    assert victim.pid != victim_pid and other.pid == other_pid
    assert replicas.restarts == restarts + 1 and replicas.poison_isolated == poison


@pytest.mark.parametrize("marker", ["@@crash@@", "@@raise@@"])
def test_a_poison_request_is_blamed_alone_among_batches_on_every_replica(replicas, marker):
    poison = replicas.poison_isolated
    flight = InFlight(replicas)
    for k in range(4):
        texts = [f"t{k}.{i}" if (k, i) != (1, 2) else f"t{k}.{i} {marker}" for i in range(6)]
        flight.start(f"b{k}", FAULTY, requests(f"b{k}", texts))
    outcomes = flight.join()
    for k in range(4):
        assert_all_ok_but(outcomes[f"b{k}"], bad=2 if k == 1 else None)
    assert outcomes["b1"][2].error_code == "POISON_INPUT"
    assert replicas.poison_isolated == poison + 1
    assert_all_ok_but(replicas.run_batch(TINY, requests("c", ["after"])), bad=None)


def test_a_lora_loads_on_every_replica_counted_per_copy_and_mixes_in_batches(replicas):
    plain = replicas.run_batch(TINY, requests("p", ["a text", "another"]))
    size = replicas.load(TINY, "lora-a")
    key = lora_key(TINY, "lora-a")
    copies = [r.resident[key] for r in replicas.replicas]
    assert all(c > 0 for c in copies) and size == sum(copies) == replicas.resident[key]
    try:
        mixed = [Request(f"m{i}", "encode", {"items": [{"text": t}, {"text": "and more"}],
                                             "options": {"lora": "lora-a"} if i % 2 else {}})
                 for i, t in enumerate(["a text", "a text", "another", "another"])]
        # Every replica serves the mix: run it on both at once.
        flight = InFlight(replicas)
        flight.start("x", TINY, mixed)
        flight.start("y", TINY, mixed)
        outcomes = flight.join()
        for name in ("x", "y"):
            got = outcomes[name]
            np.testing.assert_allclose(vectors(got[0]), vectors(plain[0]), rtol=1e-5, atol=1e-6)
            assert not np.allclose(vectors(got[1]), vectors(got[0]), atol=1e-3)  # the LoRA's
            np.testing.assert_allclose(vectors(got[1]), vectors(outcomes["x"][1]), rtol=1e-5,
                                       atol=1e-6)
    finally:
        replicas.unload(TINY, "lora-a")
    assert key not in replicas.resident
    assert all(key not in r.resident for r in replicas.replicas)


def test_a_model_loads_and_unloads_on_every_replica(catalog_dir):
    runtime = replica_set(catalog_dir, [])
    try:
        assert runtime.resident == {}
        size = runtime.load(TINY)
        copies = [r.resident[TINY] for r in runtime.replicas]
        assert all(c > 0 for c in copies) and size == sum(copies) == runtime.resident[TINY]
        assert runtime.estimate_bytes(TINY) == 2 * runtime.replicas[0].estimate_bytes(TINY)
        assert_all_ok_but(runtime.run_batch(TINY, requests("a", ["x", "y"])), bad=None)
        with pytest.raises(LoadFailed, match="not in the runtime's catalog"):
            runtime.load("test/nope")
        assert set(runtime.resident) == {TINY}
        runtime.unload(TINY)
        assert runtime.resident == {} and all(r.resident == {} for r in runtime.replicas)
    finally:
        runtime.close()


def test_a_cancel_reaches_the_replica_that_runs_the_request(catalog_dir):
    from tests.runtime.test_streaming import Collected, choices, generate

    runtime = replica_set(catalog_dir, [LLAMA])
    try:
        collected = Collected()
        done: list[list[Outcome]] = []
        # Both replicas busy with a stream; the cancel names one request of one of them.
        other = threading.Thread(target=lambda: runtime.run_batch(
            LLAMA, [generate("b", "a dog", max_tokens=8)]))
        other.start()
        wait_for(lambda: any(runtime._in_flight))
        thread = threading.Thread(target=lambda: done.append(runtime.run_batch(
            LLAMA, [generate("a", "the cat", max_tokens=200)], collected)))
        thread.start()
        assert collected.first.wait(60), "no delta came"
        runtime.cancel(["a"])
        thread.join(60)
        other.join(60)
        assert done, "run_batch did not return after the cancel"
        (choice,) = choices(done[0][0])
        assert choice["finish_reason"] == CANCELLED and choice["completion_tokens"] < 200
    finally:
        runtime.close()


def test_a_failed_start_of_one_replica_stops_the_others(catalog_dir):
    started: list[ProcessRuntime] = []

    def start(index: int, env: dict[str, str]) -> ProcessRuntime:
        runtime = ProcessRuntime(catalog_dir, [TINY] if index == 0 else ["test/nope"],
                                 threads=1, start_timeout=120, env={**CHILD_ENV, **env})
        started.append(runtime)
        return runtime

    with pytest.raises(Exception, match="not in the catalog"):
        ReplicaSet(start, 2)
    assert len(started) == 1
    wait_for(lambda: started[0].pid is None or
             not os.path.exists(f"/proc/{started[0].pid}"))


def test_the_replicas_share_one_emulated_device_queue(monkeypatch):
    """Two processes' passes queue one behind the other, as on one GPU: the processes of
    one device group (what a replica set names in each replica's environment)."""
    from runtimes.doubles import device_queue

    group = f"{os.getpid()}-test-{threading.get_ident()}"
    monkeypatch.setenv(DEVICE_GROUP_ENV, group)
    first, second = device_queue.make_stream(), device_queue.make_stream()  # two processes
    try:
        assert isinstance(first, device_queue.SharedStream)
        assert first.queue(100.0, 1.0) == 101.0
        assert second.queue(100.5, 1.0) == 102.0  # behind the first pass
        assert first.queue(200.0, 0.5) == 200.5  # the device was free by then
    finally:
        device_queue.queue_path(group).unlink()
    monkeypatch.delenv(DEVICE_GROUP_ENV)
    assert isinstance(device_queue.make_stream(), device_queue.Stream)


def test_a_stale_device_queue_is_removed_once_its_worker_is_gone(monkeypatch):
    from runtimes.doubles import device_queue

    gone = device_queue.queue_path("999999999-0")  # no such pid
    gone.write_bytes(b"")
    monkeypatch.setenv(DEVICE_GROUP_ENV, f"{os.getpid()}-stale-test")
    device_queue.make_stream()
    try:
        assert not gone.exists()
        assert device_queue.queue_path(f"{os.getpid()}-stale-test").exists()  # (alive)
    finally:
        device_queue.queue_path(f"{os.getpid()}-stale-test").unlink()

