"""The PyTorch engine's device seam (`runtimes.pytorch.device_seam`): the real device unless
a stand-in's setting is set or the engine is handed one; a dense batch's passes run inside
its `queued()` and the copy to the host waits for what it queued."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtimes.doubles.emulated import EmulatedDevice
from runtimes.doubles.profiles import ENV
from runtimes.pytorch import device_seam
from runtimes.pytorch.engine import TorchEngine
from tests.tiny_classifiers import run, serve
from tests.tiny_models import build_tiny_sentence_transformer

DENSE = "test/seam-dense"


@pytest.fixture(autouse=True)
def _real_device(monkeypatch) -> Iterator[None]:
    monkeypatch.delenv(ENV, raising=False)
    device_seam.install(device_seam.REAL)
    yield
    device_seam.install(device_seam.REAL)  # a later test of this process starts from it


class Recording(device_seam.RealDevice):
    """The real device that records what the forward path asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.depth = 0

    @contextmanager
    def _queued(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def queued(self):
        self.calls.append(("queued", None))
        return self._queued()

    def queued_until(self) -> float | None:
        self.calls.append(("queued_until", self.depth))
        return 12.5

    def wait_queued(self, until: float | None) -> None:
        self.calls.append(("wait_queued", until))

    def loaded(self, model: Any, model_class: Any, ref: str) -> None:
        self.calls.append(("loaded", ref))

    def stamp(self) -> dict[str, Any] | None:
        return {"device": "recording"}


def test_without_a_setting_the_engine_runs_on_the_real_device():
    engine = TorchEngine("cpu")
    assert engine.seam is device_seam.REAL and device_seam.current() is device_seam.REAL
    assert engine.stamp() is None


def test_a_stand_ins_setting_installs_it_when_the_engine_starts(monkeypatch):
    monkeypatch.setenv(ENV, "1,0")
    engine = TorchEngine("cpu")
    assert isinstance(engine.seam, EmulatedDevice) and device_seam.current() is engine.seam
    stamp = engine.stamp()
    assert stamp is not None and stamp["device"] == "emulated:explicit/1,0"


def test_an_engine_handed_a_seam_uses_it(monkeypatch):
    monkeypatch.setenv(ENV, "1,0")  # (the seam handed over comes first)
    seam = Recording()
    engine = TorchEngine("cpu", seam=seam)
    assert engine.seam is seam and device_seam.current() is seam
    assert engine.stamp() == {"device": "recording"}


def test_a_dense_batch_queues_its_passes_and_the_host_copy_waits_for_them(tmp_path: Path):
    path = build_tiny_sentence_transformer(tmp_path / "dense", pooling="mean", normalize=True)
    seam = Recording()
    device_seam.install(seam)
    host = serve(DENSE, "dense", path, dims=32)
    assert ("loaded", str(path)) in seam.calls  # after the load, the model was handed over
    seam.calls.clear()
    (outcome,) = run(host, DENSE, "encode", {"items": [{"text": "a"}, {"text": "b c"}]})
    assert outcome.ok, outcome.error_message
    vectors = np.frombuffer(outcome.result["embeddings"], "<f4").reshape(2, 32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)  # the model's
    # The copy is made inside the queued passes and waits, later, for what they queued.
    assert seam.calls == [("queued", None), ("queued_until", 1), ("wait_queued", 12.5)]
