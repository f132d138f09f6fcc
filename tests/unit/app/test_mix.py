"""app.tuning.mix: distribution specs, bounds, determinism and the heavy tail."""

from __future__ import annotations

import random
import statistics

import pytest

from app.tuning.mix import VOCABULARY, describe, make_requests, parse_dist, summarize


def draws(spec: str, n: int = 4000, seed: int = 1) -> list[int]:
    dist, rng = parse_dist(spec), random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


@pytest.mark.parametrize(("spec", "low", "high"), [
    ("1", 1, 1), ("7", 7, 7), ("uniform:1:8", 1, 8), ("uniform:3:3", 3, 3),
    ("pareto:1.2:1:64", 1, 64), ("lognormal:2.3:0.6:3:200", 3, 200),
    ("choice:1,1,1,4,16", 1, 16), (" Uniform:2:5 ", 2, 5),
])
def test_draws_stay_within_bounds(spec: str, low: int, high: int) -> None:
    values = draws(spec)
    assert all(isinstance(v, int) for v in values)
    assert low <= min(values) and max(values) <= high


def test_uniform_and_choice_cover_their_values() -> None:
    assert set(draws("uniform:1:8")) == set(range(1, 9))
    values = draws("choice:1,1,1,4,16")
    assert set(values) == {1, 4, 16}
    assert values.count(1) > values.count(4)  # repeating a value weights it


def test_pareto_has_a_heavy_tail() -> None:
    values = draws("pareto:1.2:1:64")
    typical = statistics.median(values)
    assert typical <= 3
    assert max(values) >= 10 * typical
    assert statistics.fmean(values) > typical  # skewed right
    assert sum(v >= 32 for v in values) > 0


def test_lognormal_centres_near_exp_mu() -> None:
    values = draws("lognormal:2.3:0.3:1:1000")
    assert 8 <= statistics.median(values) <= 12  # exp(2.3) ~ 10


def test_requests_are_deterministic_for_a_seed() -> None:
    a = make_requests(50, "pareto:1.2:1:64", "uniform:2:30", seed=3)
    b = make_requests(50, "pareto:1.2:1:64", "uniform:2:30", seed=3)
    c = make_requests(50, "pareto:1.2:1:64", "uniform:2:30", seed=4)
    assert a == b
    assert a != c


def test_the_words_spec_does_not_change_the_items_per_request() -> None:
    a = make_requests(50, "uniform:1:8", "3", seed=0)
    b = make_requests(50, "uniform:1:8", "uniform:10:20", seed=0)
    assert [len(r) for r in a] == [len(r) for r in b]


def test_texts_have_the_drawn_number_of_words() -> None:
    requests = make_requests(40, "uniform:1:4", "uniform:5:9", seed=0)
    for texts in requests:
        assert 1 <= len(texts) <= 4
        for text in texts:
            words = text.rstrip(".").lower().split()
            assert 5 <= len(words) <= 9
            assert set(words) <= set(VOCABULARY)
    assert all(len(t.split()) == 6 for r in make_requests(5, "2", "6") for t in r)


def test_summary() -> None:
    requests = [["a b c"], ["a b", "a b c d e", "x"]]
    summary = summarize(requests, "choice:1,3", "uniform:1:5", seed=9)
    assert summary.requests == 2 and summary.items == 4
    assert summary.mean_items == 2.0 and summary.max_items == 3
    assert summary.mean_words == 11 / 4 and summary.max_words == 5
    line = describe(summary)
    assert "choice:1,3" in line and "max 3" in line and "seed 9" in line


@pytest.mark.parametrize(("spec", "match"), [
    ("", "empty"),
    ("0", ">= 1"),
    ("-2", ">= 1"),
    ("1.5", "integer"),
    ("1:2", "no parameters"),
    ("uniform:5", "MIN:MAX"),
    ("uniform:8:1", "greater than MAX"),
    ("uniform:a:3", "integer"),
    ("pareto:0:1:64", "SHAPE must be > 0"),
    ("pareto:1.2:1", "SHAPE:MIN:MAX"),
    ("pareto:x:1:64", "number"),
    ("lognormal:2:-1:1:10", "SIGMA"),
    ("lognormal:2:1:1", "MU:SIGMA:MIN:MAX"),
    ("lognormal:nan:1:1:10", "finite"),
    ("choice:", "comma-separated"),
    ("choice:1,,2", "comma-separated"),
    ("choice:1,0", ">= 1"),
    ("zipf:1:2", "unknown kind 'zipf'"),
])
def test_bad_specs_say_what_is_wrong(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_dist(spec)
    assert "forms:" in str(info.value)


def test_bad_count() -> None:
    with pytest.raises(ValueError, match="count"):
        make_requests(0, "1", "1")
