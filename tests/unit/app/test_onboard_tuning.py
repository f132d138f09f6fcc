"""The onboarding tuner's pure rules: when the token-budget search moves, and which
candidates the in-process screen lets through to a live sweep."""

from __future__ import annotations

from app.onboard.tuning import SEARCH_TIE, clearly_better, device_candidates, measured_throughput
from app.tuning.knee import Knee, Point


def knee(throughput: float, p99: float) -> Knee:
    return Knee(Point(4, throughput, p99 / 2, p99), 0, p99 / 2, p99, True, "")


def test_the_token_budget_search_moves_only_for_a_clearly_better_knee():
    assert not clearly_better(knee(99, 20), knee(100, 90))  # lower p99, less throughput
    assert not clearly_better(knee(100 * (1 + SEARCH_TIE) - 1, 90), knee(100, 90))
    assert clearly_better(knee(100 * (1 + SEARCH_TIE) + 1, 90), knee(100, 90))
    assert clearly_better(knee(10, 90), None) and not clearly_better(None, knee(100, 90))


def test_the_screen_measures_full_batches_not_the_fit():
    # Small batches are slow per token; the largest quarter says what full batches do.
    samples = [(10, 5, 0.01), (20, 5, 0.015), (400, 10, 0.1), (800, 10, 0.2)]
    assert measured_throughput(samples) == 800 / 0.2


class _Facts:
    """What the registry reads of an entry (`tasks.engines.EntryFacts`)."""

    def __init__(self, adapter: str) -> None:
        self.adapter, self.pooling, self.loras = adapter, None, {}


def test_candidates_and_the_only_filter():
    import torch

    cuda = torch.cuda.is_available()
    reduced_onnx = "fp16" if cuda else "int8"
    assert ("onnx", reduced_onnx) in device_candidates(_Facts("dense"))
    assert all(runtime == "pytorch" for runtime, _ in device_candidates(_Facts("causal-lm")))
    assert device_candidates(_Facts("dense"), ["pytorch:fp32"]) == [("pytorch", "fp32")]
    # The same pairs in the same order as before the registry was asked (issue 55).
    expected = ([("pytorch", "fp32"), ("pytorch", "bf16")] + [("pytorch", "fp16")] * cuda
                + [("onnx", "fp32"), ("onnx", reduced_onnx)])
    assert device_candidates(_Facts("dense")) == expected
