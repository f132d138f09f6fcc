"""The model runtime in its own process: results, crashes, exceptions, kills, shutdown.

One real runtime process (tiny models) is shared by the module; tests that
crash it check that it came back. `test/faulty` and `test/faulty-score`
misbehave on marker texts (runtimes.doubles.faulty); `test/tiny` is the
dense one's weights with the plain adapter.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from runtimes.base import Outcome, Request, RuntimeClosed, RuntimeStartError, RuntimeUnhealthy
from runtimes.child_side import server
from runtimes.child_side.host import ModelHost
from runtimes.doubles.faulty import EVERY_BATCH_ENV, AdapterRefused
from runtimes.wire import frames, protocol
from runtimes.worker_side.process import ProcessRuntime
from tasks.catalog import Catalog
from tests.slow_batches import SlowBatches
from tests.tiny_classifiers import build_tiny_cross_encoder
from tests.tiny_models import build_tiny_sentence_transformer

TINY, FAULTY, FAULTY_SCORE = "test/tiny", "test/faulty", "test/faulty-score"
SLOW_S = 1.0
SLOW = SlowBatches(Path(tempfile.mkdtemp(prefix="shoal-process-slow-")), SLOW_S)
CHILD_ENV = SLOW.env


@pytest.fixture(autouse=True)
def _no_batch_held():
    """A test that fails while holding a slow batch does not leave it held for the next."""
    yield
    SLOW.release()


@pytest.fixture(scope="module")
def catalog_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("process-runtime")
    weights = build_tiny_sentence_transformer(root / "tiny", pooling="mean", normalize=True)
    reranker = build_tiny_cross_encoder(root / "reranker")
    directory = root / "catalog"
    directory.mkdir()
    for name, model_id, adapter in (("tiny", TINY, "dense"), ("faulty", FAULTY, "dense-faulty")):
        entry = {"id": model_id, "adapter": adapter, "source": {"path": str(weights)}, "dims": 32}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(entry))
    entry = {"id": FAULTY_SCORE, "adapter": "cross-encoder-faulty",
             "source": {"path": str(reranker)}}
    (directory / "faulty-score.yaml").write_text(yaml.safe_dump(entry))
    return directory


@pytest.fixture(scope="module")
def runtime(catalog_dir: Path):
    with ProcessRuntime(catalog_dir, [TINY, FAULTY, FAULTY_SCORE], threads=1, start_timeout=60,
                        env=CHILD_ENV) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def broken(catalog_dir: Path):
    """A runtime that crashes on every batch, whatever the input (like a broken device)."""
    with ProcessRuntime(catalog_dir, [FAULTY, FAULTY_SCORE], threads=1, start_timeout=60,
                        env={**CHILD_ENV, EVERY_BATCH_ENV: "@@crash@@"}) as runtime:
        yield runtime


def encode(*texts: str, **options) -> dict:
    return {"items": [{"text": t} for t in texts], "options": options}


def batch(*kwargs_list: dict) -> list[Request]:
    return [Request(f"r{i}", "encode", kw) for i, kw in enumerate(kwargs_list)]


def vectors(outcome: Outcome) -> np.ndarray:
    result = outcome.result
    assert result is not None, outcome.error_message
    return np.frombuffer(result["embeddings"], "<f4").reshape(result["count"], result["dims"])


def score(*texts: str, query: str = "a query") -> dict:
    return {"query": query, "items": [{"text": t} for t in texts]}


def eight_with(marker: str, at: int) -> list[Request]:
    return batch(*(encode(f"text {i} {marker if i == at else ''}", "and more")
                   for i in range(8)))


def eight_scores_with(marker: str, at: int) -> list[Request]:
    return [Request(f"r{i}", "score", score(f"text {i} {marker if i == at else ''}", "and more"))
            for i in range(8)]


def lone(model: str, text: str) -> list[Request]:
    return [Request("r0", "score", score(text))] if model == FAULTY_SCORE else batch(encode(text))


def assert_all_ok_but(outcomes: list[Outcome], bad: int | None) -> None:
    for i, outcome in enumerate(outcomes):
        assert outcome.ok == (i != bad), (i, outcome.error_code, outcome.error_message)
        if i != bad:
            result = outcome.result
            if "scores" in result:
                assert len(result["scores"]) == 2
            else:
                assert vectors(outcome).shape == (2, 32)


def test_results_match_the_in_process_host(runtime, catalog_dir):
    requests = batch(encode("The cat sits on the mat.", "Grüße aus Köln 🚀"),
                     encode("dims", dimensions=8, normalize=False),
                     encode("word " * 300))
    remote = runtime.run_batch(TINY, requests)
    host = ModelHost(threads=1)
    host.load(Catalog.from_dir(catalog_dir).require([TINY]))
    local = host.run_batch(TINY, requests)
    assert [o.id for o in remote] == ["r0", "r1", "r2"]
    for a, b in zip(remote, local, strict=True):
        assert a.ok and b.ok
        np.testing.assert_allclose(vectors(a), vectors(b), rtol=1e-5, atol=1e-6)
        assert {k: v for k, v in a.result.items() if k not in ("embeddings", "batch")} == \
               {k: v for k, v in b.result.items() if k not in ("embeddings", "batch")}
    # The faulty adapter computes the same thing when no marker is present.
    np.testing.assert_allclose(vectors(runtime.run_batch(FAULTY, requests[:1])[0]),
                               vectors(local[0]), rtol=1e-5, atol=1e-6)


def test_bad_requests_fail_alone(runtime):
    outcomes = runtime.run_batch(FAULTY, [
        Request("ok", "encode", encode("fine")),
        Request("text", "encode", {"items": [{"text": 3}]}),
        Request("opts", "encode", encode("x", dimensions=999)),
        Request("shape", "encode", ["not", "a", "map"]),  # type: ignore[arg-type]
        Request("long", "encode", encode("word " * 200, truncate=False)),
        Request("op", "score", encode("x")),
    ])
    codes = {o.id: o.error_code for o in outcomes}
    assert codes == {"ok": None, "text": "VALIDATION_ERROR", "opts": "VALIDATION_ERROR",
                     "shape": "VALIDATION_ERROR", "long": "INPUT_TOO_LONG",
                     "op": "UNSUPPORTED_OPERATION"}
    (unknown,) = runtime.run_batch("test/nope", [Request("x", "encode", encode("x"))])
    assert unknown.error_code == "MODEL_NOT_FOUND"


def test_a_crashing_request_is_isolated_and_the_runtime_restarts(runtime):
    pid, restarts, poison = runtime.pid, runtime.restarts, runtime.poison_isolated
    outcomes = runtime.run_batch(FAULTY, eight_with("@@crash@@", at=5))
    assert_all_ok_but(outcomes, bad=5)
    assert outcomes[5].error_code == "POISON_INPUT"
    assert "crashed the model runtime (killed by SIGSEGV)" in outcomes[5].error_message
    assert runtime.pid != pid and runtime.restarts > restarts
    assert runtime.poison_isolated == poison + 1
    assert_all_ok_but(runtime.run_batch(FAULTY, eight_with("", at=0)), bad=None)


def test_a_raising_request_is_isolated_without_restart(runtime):
    pid, restarts, poison = runtime.pid, runtime.restarts, runtime.poison_isolated
    outcomes = runtime.run_batch(FAULTY, eight_with("@@raise@@", at=2))
    assert_all_ok_but(outcomes, bad=2)
    assert outcomes[2].error_code == "POISON_INPUT"
    assert "RuntimeError('faulty adapter: input contains @@raise@@')" in outcomes[2].error_message
    assert (runtime.pid, runtime.restarts) == (pid, restarts)
    assert runtime.poison_isolated == poison + 1


@pytest.mark.parametrize("marker", ["@@crash@@", "@@raise@@"])
def test_a_poison_request_of_a_score_model_is_isolated(runtime, marker):
    """The same bisection for a model of another operation than encode."""
    restarts, poison = runtime.restarts, runtime.poison_isolated
    outcomes = runtime.run_batch(FAULTY_SCORE, eight_scores_with(marker, at=6))
    assert_all_ok_but(outcomes, bad=6)
    assert outcomes[6].error_code == "POISON_INPUT"
    assert runtime.poison_isolated == poison + 1
    assert (runtime.restarts > restarts) == (marker == "@@crash@@")
    # A marker in the query blames the request just the same.
    first, second = runtime.run_batch(FAULTY_SCORE, [
        Request("a", "score", score("x", query=f"why {marker}")),
        Request("b", "score", score("y")),
    ])
    assert first.error_code == "POISON_INPUT" and second.ok


@pytest.mark.parametrize("model", [FAULTY, FAULTY_SCORE])
def test_a_lone_failing_request_is_blamed_only_if_the_runtime_still_works(runtime, broken, model):
    poison = runtime.poison_isolated
    (outcome,) = runtime.run_batch(model, lone(model, "@@raise@@"))
    assert outcome.error_code == "POISON_INPUT" and runtime.poison_isolated == poison + 1
    # Nothing else in the batch succeeded, so the probe decides; in a runtime that
    # crashes whatever the input it fails too.
    with pytest.raises(RuntimeUnhealthy, match="fails even on a known-good request"):
        broken.run_batch(model, lone(model, "a fine text"))
    assert broken.poison_isolated == 0


def test_the_probe_is_refused_for_a_model_not_served(runtime):
    assert "MODEL_NOT_FOUND" in runtime.probe("test/nope")


@pytest.mark.parametrize("size", [4, 1])
def test_an_external_kill_blames_nobody(runtime, size):
    """SIGKILL mid-batch (like the OOM killer): after a restart every request succeeds."""
    pid, restarts, poison = runtime.pid, runtime.restarts, runtime.poison_isolated
    requests = batch(*(encode(f"t{i}", "@@slow@@" if i == 0 else "x") for i in range(size)))
    done: list[list[Outcome]] = []
    started = SLOW.started()
    SLOW.hold()
    thread = threading.Thread(target=lambda: done.append(runtime.run_batch(FAULTY, requests)))
    thread.start()
    SLOW.wait_started(started + 1)  # the batch is in the runtime, sleeping till released
    os.kill(pid, signal.SIGKILL)
    SLOW.release()  # its run again on the next child sleeps SLOW_S only
    thread.join(60)
    assert done, "run_batch did not return"
    assert_all_ok_but(done[0], bad=None)
    assert runtime.pid != pid and runtime.restarts == restarts + 1
    assert runtime.poison_isolated == poison


def test_close_stops_the_child_even_mid_batch(catalog_dir):
    runtime = ProcessRuntime(catalog_dir, [FAULTY], threads=1, start_timeout=60, env=CHILD_ENV)
    pid = runtime.pid
    assert pid is not None
    errors: list[BaseException] = []

    def run() -> None:
        try:
            runtime.run_batch(FAULTY, batch(encode("@@slow@@")))
        except BaseException as exc:
            errors.append(exc)

    started = SLOW.started()
    SLOW.hold()
    thread = threading.Thread(target=run)
    thread.start()
    SLOW.wait_started(started + 1)  # the batch is in the child, held there
    runtime.close()  # from another thread than the batch's
    thread.join(10)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], RuntimeClosed)
    with pytest.raises(ProcessLookupError):  # gone and reaped: not even a zombie
        os.kill(pid, 0)
    with pytest.raises(RuntimeClosed):
        runtime.run_batch(FAULTY, batch(encode("x")))
    runtime.close()  # twice is fine


def test_a_hung_request_is_killed_after_the_batch_timeout_and_isolated(catalog_dir):
    with ProcessRuntime(catalog_dir, [FAULTY], threads=1, start_timeout=60, env=CHILD_ENV,
                        batch_timeout=SLOW_S / 2) as runtime:
        pid = runtime.pid
        hung, fine = runtime.run_batch(FAULTY, batch(encode("@@slow@@"), encode("fine")))
        assert hung.error_code == "POISON_INPUT"
        assert "batch timeout" in hung.error_message
        assert fine.ok and vectors(fine).shape == (1, 32)
        assert runtime.pid != pid and runtime.restarts >= 1


def test_a_failed_start_reports_the_child_output(catalog_dir):
    with pytest.raises(RuntimeStartError) as err:
        ProcessRuntime(catalog_dir, ["test/nope"], start_timeout=60)
    message = str(err.value)
    assert "exited during start-up (exit code 1)" in message
    assert "CatalogError" in message and "not in the catalog" in message


def test_the_faulty_adapter_needs_the_test_switch(catalog_dir, monkeypatch):
    monkeypatch.delenv("SHOAL_ALLOW_TEST_ADAPTERS", raising=False)
    with pytest.raises(AdapterRefused, match="SHOAL_ALLOW_TEST_ADAPTERS=1"):
        ModelHost().load(Catalog.from_dir(catalog_dir).require([FAULTY]))


def test_frames_round_trip_and_fail_clearly(monkeypatch):
    a, b = socket.socketpair()
    with a, b:
        message = {"op": "run", "bytes": b"\x00\xff", "n": [1, 2.5, None], "ü": "✓"}
        protocol.send_frame(a, message)
        assert protocol.recv_frame(b) == message
        a.sendall(b"\x00\x00\x00\x01\xc1")  # 0xc1 is never valid msgpack
        with pytest.raises(protocol.ProtocolError, match="not msgpack"):
            protocol.recv_frame(b)
        monkeypatch.setattr(protocol, "MAX_FRAME_BYTES", 8)
        with pytest.raises(protocol.FrameTooLarge, match="over the 8-byte limit"):
            protocol.send_frame(a, "x" * 100)
        a.sendall(b"\x00\x00\x01\x00")
        with pytest.raises(protocol.FrameTooLarge, match="256-byte frame"):
            protocol.recv_frame(b)
        a.sendall(b"\x00\x00")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(protocol.ConnectionClosed, match="middle of a frame"):
            protocol.recv_frame(b)


class _RaisingHost:
    def __init__(self, device: str, error: Exception) -> None:
        self.device, self.error = device, error

    def run_batch(self, model_id, requests, on_deltas=None):
        raise self.error


@pytest.mark.parametrize("device,error,fatal", [
    ("cuda", RuntimeError("CUDA error: device-side assert triggered"), True),
    ("cuda:1", RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"), True),
    ("cuda", RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    ("cpu", RuntimeError("CUDA error: (a message, but no device to lose)"), False),
    ("cuda", ValueError("bad shape"), False),
])
def test_the_server_exits_after_errors_that_leave_the_device_unusable(device, error, fatal):
    frame = frames.Run("m", [frames.RunRequest("a", "encode", {})])
    reply, exit_after = server.handle(_RaisingHost(device, error), frame)  # type: ignore[arg-type]
    assert reply == frames.Failed(repr(error), fatal) and exit_after == fatal


def _answer(raw: object) -> object:
    """What a runtime's batch connection answers `raw` (any msgpack value) with."""
    a, b = socket.socketpair()
    with a, b:
        protocol.send_frame(a, raw)
        frame = server.read_request(b)
    if isinstance(frame, frames.Rejected):
        return frame
    return server.handle(_RaisingHost("cpu", RuntimeError()), frame)[0]  # type: ignore[arg-type]


def test_the_server_answers_malformed_frames_with_an_error():
    not_a_map = _answer(["run"])
    assert isinstance(not_a_map, frames.Rejected) and "got `array`" in not_a_map.reason
    unknown = _answer({"frame": "nope"})
    assert isinstance(unknown, frames.Rejected) and "Invalid value 'nope'" in unknown.reason
    malformed = _answer({"frame": "run", "model": "m"})
    assert isinstance(malformed, frames.Rejected) and "missing required field" in malformed.reason
    assert _answer({"frame": "ping"}) == frames.Pong(os.getpid())
