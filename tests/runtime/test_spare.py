"""The spare runtime: a crash promotes a process imported ahead, and a crash during a
restart is retried (runtimes.worker_side.process, `spare=True`; the worker's SHOAL_RUNTIME_SPARE).

Real child processes on tiny models. `test/faulty` crashes, raises or stalls on marker
texts (runtimes.doubles.faulty); `test/lora` is a dense model with one LoRA adapter.
Each test starts its own runtime: they kill its processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from batching.pool import lora_key
from runtimes.base import Outcome, Request, RuntimeStartError
from runtimes.worker_side.process import ProcessRuntime
from runtimes.worker_side.supervisor import RESTART_ATTEMPTS
from tests.slow_batches import SlowBatches
from tests.stack import wait_for
from tests.tiny_lora import BERT_TARGETS, build_tiny_lora
from tests.tiny_models import build_tiny_sentence_transformer

FAULTY, TINY, LORA_MODEL, LORA, BREAKABLE = (
    "test/faulty", "test/tiny", "test/lora", "alpha", "test/breakable")
SLOW_S = 1.0
SLOW = SlowBatches(Path(tempfile.mkdtemp(prefix="shoal-spare-slow-")), SLOW_S)
CHILD_ENV = SLOW.env
START_S = 120  # a spare imports torch and transformers: seconds on a busy 2-core host
GONE = "failed loading test/breakable|breakable does not exist"  # its weights deleted


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spare-weights")
    base = build_tiny_sentence_transformer(root / "tiny", pooling="mean", normalize=True)
    lora = build_tiny_lora(base, root / "tiny-lora", targets=BERT_TARGETS, seed=7)
    return base, lora


@pytest.fixture
def catalog_dir(weights: tuple[Path, Path], tmp_path: Path) -> Path:
    """The catalog; `test/breakable` has weights of its own that a test may delete."""
    base, lora = weights
    breakable = shutil.copytree(base, tmp_path / "breakable")
    directory = tmp_path / "catalog"
    directory.mkdir()
    entries = {
        "faulty": {"id": FAULTY, "adapter": "dense-faulty", "source": {"path": str(base)},
                   "dims": 32},
        "tiny": {"id": TINY, "adapter": "dense", "source": {"path": str(base)}, "dims": 32},
        "lora": {"id": LORA_MODEL, "adapter": "dense", "source": {"path": str(base)},
                 "dims": 32, "loras": {LORA: {"path": str(lora)}}},
        "breakable": {"id": BREAKABLE, "adapter": "dense", "source": {"path": str(breakable)},
                      "dims": 32},
    }
    for name, entry in entries.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(entry))
    return directory


@contextlib.contextmanager
def started(catalog_dir: Path, models: list[str], spare: bool = True,
            answer_while_restarting: bool = False) -> Iterator[ProcessRuntime]:
    """A runtime whose spare (when on) has finished importing; closed at the end, and
    every process it ever had is gone then."""
    runtime = ProcessRuntime(catalog_dir, models, threads=1, start_timeout=START_S,
                             env=CHILD_ENV, spare=spare,
                             answer_while_restarting=answer_while_restarting)
    pids: set[int] = set()
    watching = threading.Event()

    def watch() -> None:  # every pid the runtime had, to check none outlives it
        while not watching.is_set():
            pids.update(p for p in (runtime.pid, runtime.spare_pid) if p is not None)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        if spare:
            wait_for(runtime.spare_ready, START_S, "the spare to finish importing")
        yield runtime
    finally:
        runtime.close()
        watching.set()
        watcher.join()
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # gone and reaped: not even a zombie
            os.kill(pid, 0)


def encode(text: str, **options) -> dict:
    return {"items": [{"text": text}, {"text": "and more"}], "options": options}


def slow_batch(size: int) -> list[Request]:
    """A batch that stays in the runtime for SLOW_S (its first request stalls)."""
    return [Request(f"r{i}", "encode", encode(f"t{i} {'@@slow@@' if i == 0 else ''}"))
            for i in range(size)]


def vectors(outcome: Outcome) -> np.ndarray:
    result = outcome.result
    assert result is not None, (outcome.error_code, outcome.error_message)
    return np.frombuffer(result["embeddings"], "<f4").reshape(result["count"], result["dims"])


def assert_all_ok(outcomes: list[Outcome], size: int) -> None:
    assert [o.id for o in outcomes] == [f"r{i}" for i in range(size)]
    for outcome in outcomes:
        assert outcome.ok, (outcome.id, outcome.error_code, outcome.error_message)
        assert vectors(outcome).shape == (2, 32)


def run_killing(runtime: ProcessRuntime, requests: list[Request],
                then: Callable[[], None] | None = None) -> list[Outcome]:
    """Run a slow batch, SIGKILL the child while the batch is in it, then call `then` (on
    this thread, while the batch recovers); the batch's outcomes."""
    done: list[list[Outcome]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            done.append(runtime.run_batch(FAULTY, requests))
        except BaseException as exc:
            errors.append(exc)

    pid = runtime.pid
    assert pid is not None
    started = SLOW.started()
    SLOW.hold()
    thread = threading.Thread(target=run)
    thread.start()
    try:
        SLOW.wait_started(started + 1)  # the batch is in the runtime, held there
        os.kill(pid, signal.SIGKILL)
    finally:
        SLOW.release()  # its run again on the next child sleeps SLOW_S only
    try:
        if then is not None:
            then()
    finally:
        thread.join(START_S * RESTART_ATTEMPTS)
    assert not thread.is_alive(), "run_batch did not return"
    assert not errors, errors
    return done[0]


def test_a_kill_promotes_the_spare_with_every_resident_model(catalog_dir):
    """Pinned, lazily loaded and LoRA: all resident again in the promoted spare."""
    with started(catalog_dir, [FAULTY]) as runtime:
        runtime.load(TINY)
        runtime.load(LORA_MODEL)
        runtime.load(LORA_MODEL, LORA)
        through_lora = [Request("l", "encode", encode("a text", lora=LORA))]
        before = vectors(runtime.run_batch(LORA_MODEL, through_lora)[0])
        pid, spare, restarts = runtime.pid, runtime.spare_pid, runtime.restarts
        assert spare is not None and spare != pid

        outcomes = run_killing(runtime, slow_batch(4))

        assert_all_ok(outcomes, 4)
        assert runtime.pid == spare  # the spare, promoted
        assert runtime.restarts == restarts + 1 and runtime.spare_promotions == 1
        assert runtime.poison_isolated == 0 and runtime.start_failures == 0
        assert runtime.spare_pid not in (None, pid, spare)  # the next spare
        assert set(runtime.resident) == {FAULTY, TINY, LORA_MODEL, lora_key(LORA_MODEL, LORA)}
        assert all(size > 0 for size in runtime.resident.values())
        (tiny,) = runtime.run_batch(TINY, [Request("t", "encode", encode("x"))])
        assert vectors(tiny).shape == (2, 32)
        after = vectors(runtime.run_batch(LORA_MODEL, through_lora)[0])
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
        wait_for(runtime.spare_ready, START_S, "the next spare")


def test_a_kill_while_the_spare_is_promoted_is_retried(catalog_dir):
    """The spare dies while it is taking over (it is stopped, so the kill surely comes
    before it is ready): the restart is tried again, with the next spare."""
    with started(catalog_dir, [FAULTY, TINY]) as runtime:
        spare = runtime.spare_pid
        assert spare is not None
        os.kill(spare, signal.SIGSTOP)
        try:
            def kill_the_promoted_spare() -> None:
                wait_for(lambda: runtime.pid == spare, 30, "the spare's promotion", interval=0.01)
                os.kill(spare, signal.SIGKILL)

            outcomes = run_killing(runtime, slow_batch(4), then=kill_the_promoted_spare)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(spare, signal.SIGKILL)
        assert_all_ok(outcomes, 4)
        assert runtime.start_failures == 1
        assert runtime.spare_promotions == 2 and runtime.restarts == 2
        assert runtime.pid not in (None, spare)
        assert set(runtime.resident) == {FAULTY, TINY}


def test_without_spares_a_kill_during_the_restart_is_retried(catalog_dir):
    """SHOAL_RUNTIME_SPARE=0: a fresh child replaces the dead one, as before; killed
    while it imports, it is started again."""
    with started(catalog_dir, [FAULTY], spare=False) as runtime:
        assert runtime.spare_pid is None
        first = runtime.pid
        killed: list[int] = []

        def kill_the_replacement() -> None:
            # It imports torch for seconds: a kill within milliseconds of its start
            # lands during the restart.
            new = wait_for(lambda: (p := runtime.pid) not in (None, first) and p, 30,
                           "a replacement child", interval=0.01)
            os.kill(new, signal.SIGKILL)
            killed.append(new)

        outcomes = run_killing(runtime, slow_batch(4), then=kill_the_replacement)
        assert_all_ok(outcomes, 4)
        assert runtime.start_failures == 1 and runtime.restarts == 2
        assert runtime.spare_promotions == 0 and runtime.spare_pid is None
        assert runtime.pid not in (None, first, *killed)


def test_without_spares_a_kill_restarts_a_fresh_child(catalog_dir):
    with started(catalog_dir, [FAULTY], spare=False) as runtime:
        pid = runtime.pid
        outcomes = run_killing(runtime, slow_batch(2))
        assert_all_ok(outcomes, 2)
        assert runtime.pid not in (None, pid)
        assert (runtime.restarts, runtime.spare_promotions, runtime.start_failures) == (1, 0, 0)
        assert runtime.spare_pid is None


def test_a_poison_request_is_isolated_with_spares(catalog_dir):
    """Every restart of the bisection promotes a spare (waiting for one still importing)."""
    with started(catalog_dir, [FAULTY]) as runtime:
        requests = [Request(f"r{i}", "encode", encode(f"text {i} {'@@crash@@' if i == 5 else ''}"))
                    for i in range(8)]
        outcomes = runtime.run_batch(FAULTY, requests)
        for i, outcome in enumerate(outcomes):
            assert outcome.ok == (i != 5), (i, outcome.error_code, outcome.error_message)
        assert outcomes[5].error_code == "POISON_INPUT"
        assert "crashed the model runtime (killed by SIGSEGV)" in outcomes[5].error_message
        assert runtime.poison_isolated == 1
        # 8 -> 4 -> 2 -> 1, and the lone request's retry: four crashes, four promotions.
        assert runtime.restarts == runtime.spare_promotions == 4
        assert runtime.start_failures == 0


def test_a_dead_spare_is_replaced_by_a_fresh_child(catalog_dir):
    with started(catalog_dir, [FAULTY]) as runtime:
        pid, spare = runtime.pid, runtime.spare_pid
        assert spare is not None
        os.kill(spare, signal.SIGKILL)
        outcomes = run_killing(runtime, slow_batch(2))
        assert_all_ok(outcomes, 2)
        assert runtime.pid not in (None, pid, spare)
        assert runtime.spare_promotions == 0 and runtime.restarts == 1
        assert runtime.spare_pid not in (None, spare)


def test_a_runtime_that_cannot_restart_fails_clearly(catalog_dir):
    """Its weights are gone: each start fails, and after RESTART_ATTEMPTS the batch's
    wait raises instead of looping."""
    with started(catalog_dir, [BREAKABLE]) as runtime:
        weights = yaml.safe_load((catalog_dir / "breakable.yaml").read_text())["source"]["path"]
        shutil.rmtree(weights)
        os.kill(runtime.pid, signal.SIGKILL)
        # The last start is a promoted spare's load, or (the next spare waits for a
        # promoted one still importing) a fresh child's: either names what is missing.
        with pytest.raises(RuntimeStartError, match=GONE):
            runtime.run_batch(BREAKABLE, [Request("r0", "encode", encode("x"))])
        assert runtime.start_failures == RESTART_ATTEMPTS


def test_close_ends_the_child_and_the_spare(catalog_dir):
    runtime = ProcessRuntime(catalog_dir, [TINY], threads=1, start_timeout=START_S,
                             spare=True)
    pid, spare = runtime.pid, runtime.spare_pid
    assert pid is not None and spare is not None
    runtime.close()  # the spare may still be importing: it ends all the same
    for process in (pid, spare):
        with pytest.raises(ProcessLookupError):
            os.kill(process, 0)
    assert runtime.spare_pid is None


# --- a failed restart while the next spare imports (answer_while_restarting, the worker's) ---


def listening(pid: int) -> bool:
    """The runtime process `pid` is done importing: its socket exists."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return Path(argv[argv.index("--socket") + 1]).exists()


def assert_unavailable(outcomes: list[Outcome], ids: list[str]) -> None:
    """Each request answered once, MODEL_UNAVAILABLE with when to retry."""
    assert [o.id for o in outcomes] == ids
    for outcome in outcomes:
        assert outcome.error_code == "MODEL_UNAVAILABLE", (outcome.id, outcome.error_code,
                                                           outcome.error_message)
        assert "still importing" in (outcome.error_message or "")
        assert outcome.stats["retry_after_s"] >= 1


def test_a_replacement_killed_while_it_loads_answers_unavailable_at_once(catalog_dir):
    """The runtime is killed, then its promoted spare while it loads: the next spare is
    still importing (held stopped here, so it surely is while the answers come). The batch
    being rerun, and a batch sent meanwhile, are answered MODEL_UNAVAILABLE, once each,
    without waiting for it; once it listens it takes over and serves."""
    with started(catalog_dir, [FAULTY, TINY], answer_while_restarting=True) as runtime:
        spare = runtime.spare_pid
        assert spare is not None
        os.kill(spare, signal.SIGSTOP)  # promoted, it cannot load before it is killed
        following: list[int] = []
        try:
            def kill_the_promoted_spare() -> None:
                wait_for(lambda: runtime.pid == spare, 30, "the spare's promotion", interval=0.01)
                # Started at the promotion: stopped at once, it is still importing.
                nxt = wait_for(lambda: (p := runtime.spare_pid) not in (None, spare) and p,
                               30, "the next spare", interval=0.01)
                os.kill(nxt, signal.SIGSTOP)
                following.append(nxt)
                assert not listening(nxt)
                os.kill(spare, signal.SIGKILL)

            outcomes = run_killing(runtime, slow_batch(4), then=kill_the_promoted_spare)
            (nxt,) = following
            # Answered while the next spare was stopped mid-import: it was not waited for.
            assert not listening(nxt)
            assert_unavailable(outcomes, [f"r{i}" for i in range(4)])
            assert runtime.pid == nxt and runtime.start_failures == 1
            later = [Request("l0", "encode", encode("later")), Request("l1", "encode", encode("x"))]
            assert_unavailable(runtime.run_batch(FAULTY, later), ["l0", "l1"])
            assert not listening(nxt)
        finally:
            for pid in (spare, *following):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.kill(spare, signal.SIGKILL)

        def served() -> bool:
            """Batches are answered, unavailable until the next spare has taken over."""
            outcomes = runtime.run_batch(FAULTY, [Request(f"r{i}", "encode", encode(f"t{i}"))
                                                  for i in range(2)])
            if outcomes[0].ok:
                assert_all_ok(outcomes, 2)
                return True
            assert_unavailable(outcomes, ["r0", "r1"])
            return False

        wait_for(served, START_S, "the next spare to take over")
        assert runtime.pid == nxt
        assert runtime.start_failures == 1 and runtime.spare_promotions == 2
        assert runtime.poison_isolated == 0
        assert set(runtime.resident) == {FAULTY, TINY}


def test_a_runtime_that_cannot_restart_fails_clearly_between_refusals(catalog_dir):
    """Answering while a failed restart's next child imports keeps the retry rule: the
    batches meanwhile are answered MODEL_UNAVAILABLE, and the RESTART_ATTEMPTS-th failed
    start in a row raises RuntimeStartError."""
    with started(catalog_dir, [BREAKABLE], answer_while_restarting=True) as runtime:
        weights = yaml.safe_load((catalog_dir / "breakable.yaml").read_text())["source"]["path"]
        shutil.rmtree(weights)
        os.kill(runtime.pid, signal.SIGKILL)
        refusals: list[int] = []

        def failed() -> bool:
            request = [Request("r0", "encode", encode("x"))]
            try:
                outcomes = runtime.run_batch(BREAKABLE, request)
            except RuntimeStartError as exc:
                assert re.search(GONE, str(exc)), exc
                return True
            assert_unavailable(outcomes, ["r0"])
            refusals.append(runtime.start_failures)
            return False

        wait_for(failed, START_S * RESTART_ATTEMPTS, "the restart to give up")
        assert runtime.start_failures == RESTART_ATTEMPTS
        assert refusals and all(0 < n < RESTART_ATTEMPTS for n in refusals)
