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


def test_candidates_and_the_only_filter():
    import torch

    reduced_onnx = "fp16" if torch.cuda.is_available() else "int8"
    assert ("onnx", reduced_onnx) in device_candidates("dense")
    assert all(runtime == "pytorch" for runtime, _ in device_candidates("causal-lm"))
    assert device_candidates("dense", ["pytorch:fp32"]) == [("pytorch", "fp32")]
