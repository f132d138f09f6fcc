"""The device's busy time on CPU: forward passes counted once, taken batch by batch.

A model whose children sleep a known time stands in for the device work, and the
test times each pass itself: hooks on the model and on its children count a pass once,
so the clock reads at least what the children slept and at most the pass's own wall
time (counting the children and the model both would read about twice that).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from runtimes.base import Request
from runtimes.child_side.host import ModelHost
from runtimes.pytorch.device_time import DeviceClock, device_clock, watch_forward
from tasks.catalog import ModelEntry
from tasks.served import batch_device_ms
from tests.tiny_models import build_tiny_sentence_transformer

NAP_S = 0.05


class Nap(nn.Module):
    """Device work of a known length: sleeps, then raises if told to."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("the device failed")
        return x


class Tower(nn.Module):
    """A model with parameters (its device comes from them) and two napping children."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.first = Nap(NAP_S)
        self.second = Nap(NAP_S)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.second(self.first(self.proj(x)))
        if self.fail:
            raise ValueError("failed after its children")
        return out


@pytest.fixture
def tower() -> tuple[Tower, DeviceClock]:
    model = Tower()
    clock = watch_forward(model)
    clock.take()  # what other tests ran on the cpu clock
    return model, clock


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def test_the_clock_is_the_devices_one():
    assert device_clock("cpu") is device_clock(torch.device("cpu"))
    assert watch_forward(Tower()) is device_clock("cpu")


def test_a_pass_counts_once_though_its_children_are_hooked(tower):
    model, clock = tower
    x = torch.ones(1, 4)
    wall = _timed(lambda: model(x))
    busy = clock.take()
    assert 2 * NAP_S <= busy <= wall


def test_passes_add_up_and_take_resets(tower):
    model, clock = tower
    x = torch.ones(1, 4)
    wall = _timed(lambda: (model(x), model(x)))
    assert 4 * NAP_S <= clock.take() <= wall
    assert clock.take() == 0.0
    assert clock.take() == 0.0


def test_a_child_called_alone_counts(tower):
    # CLIP's get_text_features runs its text tower, not the model's own forward.
    model, clock = tower
    wall = _timed(lambda: model.first(torch.ones(1, 4)))
    assert NAP_S <= clock.take() <= wall


def test_a_failing_pass_does_not_leave_the_clock_stuck(tower):
    model, clock = tower
    x = torch.ones(1, 4)
    model.second.fail = True
    with pytest.raises(RuntimeError, match="the device failed"):
        model(x)
    # The failed pass was device time too (the hooks run on the way out of an exception).
    assert clock.take() >= 2 * NAP_S
    model.second.fail = False
    # Were the pass still open, this one would count as nested in it, that is not at all.
    wall = _timed(lambda: model(x))
    assert 2 * NAP_S <= clock.take() <= wall


def test_a_failure_in_the_model_after_its_children_closes_the_pass(tower):
    model, clock = tower
    x = torch.ones(1, 4)
    model.fail = True
    with pytest.raises(ValueError, match="failed after its children"):
        model(x)
    assert clock.take() >= 2 * NAP_S
    model.fail = False
    wall = _timed(lambda: model.first(x))
    assert NAP_S <= clock.take() <= wall


# --- through the host --------------------------------------------------------------------------


MODEL = "test/device-time"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> ModelHost:
    path = build_tiny_sentence_transformer(tmp_path_factory.mktemp("dt") / "tiny",
                                           pooling="mean", normalize=True)
    host = ModelHost()
    host.load([ModelEntry.model_validate({"id": MODEL, "adapter": "dense", "dims": 32,
                                          "source": {"path": str(path)}})])
    return host


def test_a_batch_carries_its_device_time(host):
    # A pass on the same device before the batch (a load, a probe) is not the batch's;
    # an hour of it would show in any figure that counted it.
    before = Tower()
    watch_forward(before)
    before(torch.ones(1, 4))
    device_clock("cpu").bill(3600.0)
    requests = [Request("a", "encode", {"model": MODEL, "items": [{"text": "hello world"}]}),
                Request("bad", "encode", {"model": MODEL, "items": [{"text": 3}]}),
                Request("b", "encode", {"model": MODEL,
                                        "items": [{"text": "a longer text " * 8}] * 3})]
    first, bad, second = host.run_batch(MODEL, requests)
    assert first.ok and second.ok and not bad.ok
    batch = first.result["batch"]
    assert second.result["batch"] == batch  # one batch, one figure
    assert 0 < batch["device_ms"] <= batch["inference_ms"] < 3_600_000
    assert batch_device_ms([bad.result, first.result, second.result]) == batch["device_ms"]
    # The next batch's figure is its own, not the sum.
    (again,) = host.run_batch(MODEL, requests[:1])
    assert 0 < again.result["batch"]["device_ms"] <= again.result["batch"]["inference_ms"]


def test_a_batch_in_several_forward_passes_counts_them_all(tmp_path: Path):
    path = build_tiny_sentence_transformer(tmp_path / "tiny", pooling="mean", normalize=True)
    chunked = ModelHost(chunk_tokens=32)  # two of these texts per forward pass
    chunked.load([ModelEntry.model_validate({"id": MODEL, "adapter": "dense", "dims": 32,
                                             "source": {"path": str(path)}})])
    # Our own clock around each pass of the model, outside the device clock's hooks.
    model = chunked.adapter(MODEL).encoder.model
    starts: list[float] = []
    passes: list[float] = []
    model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()),
                                    prepend=True)
    model.register_forward_hook(
        lambda *_: passes.append(time.perf_counter() - starts[-1]))
    items = [{"text": f"text number {i} " * 4} for i in range(12)]
    (outcome,) = chunked.run_batch(MODEL, [Request("a", "encode",
                                                    {"model": MODEL, "items": items})])
    assert len(passes) >= 4
    batch = outcome.result["batch"]
    assert batch["device_ms"] <= sum(passes) * 1000 <= batch["inference_ms"]
    # Every pass, not only the last: none of them is a fifth of the total.
    assert batch["device_ms"] >= 0.8 * sum(passes) * 1000 > max(passes) * 1000
