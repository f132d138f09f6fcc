import math
import random
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching.former import Pending
from batching.latency_model import (
    BatchShape,
    CostModel,
    _nonnegative_quadratic_min,
    _solve_linear,
)

TRUTH = (0.01, 1e-4, 1e-7)


def _true_seconds(shape: BatchShape, padded: bool) -> float:
    a, b, c = TRUTH
    tokens = shape.items * shape.longest if padded else shape.tokens
    return a + b * tokens + c * tokens * shape.longest


def _random_shape(rng: random.Random) -> BatchShape:
    """Log-uniform sizes, so small batches are as common as big ones. With uniform
    sizes a batch small enough for the fixed overhead `a` to matter almost never
    comes up, and no estimator can then predict small batches well."""
    items = round(math.exp(rng.uniform(0.0, math.log(64))))
    longest = round(math.exp(rng.uniform(math.log(8), math.log(512))))
    return BatchShape(items, longest, rng.randint(items, items * longest))


GRID = [BatchShape(items, longest, items * longest // 2)
        for items in (1, 4, 16, 64) for longest in (8, 64, 256, 512)]


def test_shape_of_a_batch():
    batch = [Pending("a", "g", 2, 30, 20, 0.0), Pending("b", "g", 3, 12, 5, 1.0)]
    assert BatchShape.of(batch) == BatchShape(items=5, longest=20, tokens=42)
    assert BatchShape.of([]) == BatchShape(0, 0, 0)


def test_the_seed_predicts_before_any_sample():
    model = CostModel(0.005, 2e-5, 1e-8)
    shape = BatchShape(items=4, longest=100, tokens=300)
    assert model.samples == 0
    assert model.coefficients == (0.005, 2e-5, 1e-8)
    assert model.predict(shape) == pytest.approx(0.005 + 2e-5 * 400 + 1e-8 * 400 * 100)
    assert CostModel().predict(shape) == pytest.approx(0.005 + 2e-5 * 400)


def test_padded_runtimes_pay_items_times_longest_unpadded_real_tokens():
    shape = BatchShape(items=4, longest=100, tokens=300)
    padded = CostModel(0.0, 1e-4, 1e-6, padded=True)
    unpadded = CostModel(0.0, 1e-4, 1e-6, padded=False)
    assert padded.features(shape) == (1.0, 400.0, 40_000.0)
    assert unpadded.features(shape) == (1.0, 300.0, 30_000.0)
    assert padded.predict(shape) == pytest.approx(0.04 + 0.04)
    assert unpadded.predict(shape) == pytest.approx(0.03 + 0.03)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("padded", [True, False])
def test_it_learns_known_coefficients_within_ten_percent(padded, seed):
    rng = random.Random(seed)
    model = CostModel(padded=padded)  # the default seed is 2-7x too fast for TRUTH
    for _ in range(400):
        shape = _random_shape(rng)
        model.observe(shape, _true_seconds(shape, padded) * (1 + rng.gauss(0, 0.02)))
    assert model.samples == 400
    for shape in GRID:
        assert model.predict(shape) == pytest.approx(_true_seconds(shape, padded), rel=0.10)
    a, b, _ = model.coefficients
    assert a == pytest.approx(TRUTH[0], rel=0.10)
    assert b == pytest.approx(TRUTH[1], rel=0.10)


def test_it_follows_a_runtime_that_slows_down():
    """Forgetting: old measurements fade, so a model tracks a changed device."""
    rng = random.Random(7)
    model = CostModel(*TRUTH)
    for _ in range(300):
        shape = _random_shape(rng)
        model.observe(shape, 3 * _true_seconds(shape, True))
    for shape in GRID:
        assert model.predict(shape) == pytest.approx(3 * _true_seconds(shape, True), rel=0.10)


def test_a_seed_far_too_fast_is_corrected_within_a_few_hundred_batches():
    """Misses far beyond the prediction are down-weighted, not clipped: a device
    100x slower than tuned for is learnt, not mistaken for a string of stalls."""
    rng = random.Random(5)
    model = CostModel(0.005, 2e-5, 0.0)
    for _ in range(150):
        shape = _random_shape(rng)
        model.observe(shape, 100 * (0.005 + 2e-5 * shape.items * shape.longest))
    for shape in GRID:
        slow = 100 * (0.005 + 2e-5 * shape.items * shape.longest)
        assert model.predict(shape) == pytest.approx(slow, rel=0.10)


class FakeDevice:
    """A device whose true batch time is a + b*T + c*T*L (T padded tokens), with noise."""

    def __init__(self, coefficients: tuple[float, float, float], noise: float,
                 rng: random.Random) -> None:
        self.coefficients, self.noise, self.rng = coefficients, noise, rng

    def true_seconds(self, shape: BatchShape) -> float:
        a, b, c = self.coefficients
        tokens = shape.items * shape.longest
        return a + b * tokens + c * tokens * shape.longest

    def run(self, shape: BatchShape) -> float:
        return self.true_seconds(shape) * (1 + self.rng.gauss(0, self.noise))


SEED = (0.005, 2e-5, 0.0)


@pytest.mark.parametrize("rng_seed", [1, 2, 3])
@pytest.mark.parametrize("factor", [5.0, 8.0, 10.0, 0.2])
def test_a_device_5_to_10x_slower_than_seeded_is_learnt_within_a_handful_of_batches(
        factor, rng_seed):
    """The catalog profile was measured elsewhere; the device takes `factor` times as long.
    Five batches in, every shape is predicted as the device runs it."""
    rng = random.Random(rng_seed)
    device = FakeDevice(tuple(factor * v for v in SEED), 0.03, rng)
    model = CostModel(*SEED)
    for _ in range(5):
        shape = _random_shape(rng)
        model.observe(shape, device.run(shape))
    assert model.level == pytest.approx(factor, rel=0.10)
    for shape in GRID:
        assert model.predict(shape) == pytest.approx(device.true_seconds(shape), rel=0.10)


@pytest.mark.parametrize("rng_seed", [1, 2, 3])
def test_a_device_with_other_proportions_is_learnt_within_ten_batches(rng_seed):
    """8x the overhead, 6x the per-token cost and an attention term the seed lacks: the
    level is right after three batches, the proportions soon after (the prior gives way
    when batches keep disagreeing with it)."""
    rng = random.Random(rng_seed)
    device = FakeDevice((0.04, 1.2e-4, 5e-8), 0.03, rng)
    model = CostModel(*SEED)
    for _ in range(10):
        shape = _random_shape(rng)
        model.observe(shape, device.run(shape))
    for shape in GRID:
        assert model.predict(shape) == pytest.approx(device.true_seconds(shape), rel=0.20)


def test_one_stall_among_the_first_batches_does_not_set_the_level():
    rng = random.Random(4)
    device = FakeDevice(tuple(6 * v for v in SEED), 0.03, rng)
    model = CostModel(*SEED)
    for n in range(5):
        shape = _random_shape(rng)
        model.observe(shape, device.run(shape) * (1000 if n == 1 else 1))  # a first CUDA call
    assert model.level == pytest.approx(6, rel=0.10)
    for _ in range(5):  # the stall itself still pulls like one 4x miss (Huber), and fades
        shape = _random_shape(rng)
        model.observe(shape, device.run(shape))
    for shape in GRID:
        assert model.predict(shape) == pytest.approx(device.true_seconds(shape), rel=0.25)


def test_a_seed_that_was_right_stays_right_under_noisy_timings():
    rng = random.Random(8)
    device = FakeDevice(TRUTH, 0.15, rng)
    model = CostModel(*TRUTH)
    for _ in range(300):
        shape = _random_shape(rng)
        model.observe(shape, device.run(shape))
    assert model.level == pytest.approx(1.0, rel=0.15)
    for shape in GRID:
        assert model.predict(shape) == pytest.approx(device.true_seconds(shape), rel=0.15)


def test_a_few_wild_samples_cannot_make_it_absurd():
    shape = BatchShape(16, 128, 2048)
    model = CostModel(*TRUTH)
    seeded = model.predict(shape)
    model.observe(shape, 1000 * seeded)  # a stall: first CUDA call, GC pause...
    assert seeded < model.predict(shape) < 1.5 * seeded
    model = CostModel(*TRUTH)
    model.observe(shape, 0.0)
    assert 0.5 * seeded < model.predict(shape) < seeded


def test_garbage_samples_never_give_negative_predictions():
    rng = random.Random(3)
    model = CostModel()
    for _ in range(500):
        model.observe(_random_shape(rng), rng.choice([0.0, 0.0, 1e-9, 1e-3]))
    for bad in (-1.0, math.nan, math.inf, -math.inf):
        model.observe(BatchShape(4, 100, 300), bad)
    model.observe(BatchShape(0, 0, 0), 1.0)  # an empty batch
    assert model.samples == 500  # the invalid ones were ignored
    assert all(c >= 0 for c in model.coefficients)
    for shape in [*GRID, BatchShape(0, 0, 0)]:
        assert 0.0 <= model.predict(shape) < 0.01


def test_the_same_shape_over_and_over_stays_well_posed():
    """Only one direction of the coefficients is measured: the prior keeps the
    others in place instead of letting them drift (RLS wind-up)."""
    model = CostModel(*TRUTH)
    shape = BatchShape(32, 128, 4096)
    for _ in range(5000):
        model.observe(shape, _true_seconds(shape, True))
    assert model.predict(shape) == pytest.approx(_true_seconds(shape, True), rel=1e-3)
    for probe in GRID:
        assert model.predict(probe) == pytest.approx(_true_seconds(probe, True), rel=0.05)


def test_a_zero_seed_still_learns():
    rng = random.Random(11)
    model = CostModel(0.0, 0.0, 0.0)
    assert model.predict(BatchShape(4, 100, 400)) == 0.0
    for _ in range(300):
        shape = _random_shape(rng)
        model.observe(shape, _true_seconds(shape, True))
    for shape in GRID:
        assert model.predict(shape) == pytest.approx(_true_seconds(shape, True), rel=0.10)


def test_bad_parameters_are_refused():
    for kwargs in ({"forgetting": 0.0}, {"forgetting": 1.5}, {"prior_weight": 0.0}):
        with pytest.raises(ValueError):
            CostModel(**kwargs)
    with pytest.raises(ValueError):
        CostModel(-0.001)


samples = st.lists(
    st.tuples(
        st.builds(BatchShape, st.integers(0, 256), st.integers(0, 8192), st.integers(0, 10**6)),
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0.0, 100.0),
                  st.just(0.0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(samples, st.booleans(), st.floats(0.5, 1.0), st.floats(0.01, 100.0))
def test_predictions_stay_finite_and_non_negative_whatever_is_observed(
    observed, padded, forgetting, prior_weight
):
    model = CostModel(padded=padded, forgetting=forgetting, prior_weight=prior_weight)
    for shape, seconds in observed:
        model.observe(shape, seconds)
        assert all(math.isfinite(c) and c >= 0 for c in model.coefficients)
    for shape, _ in observed:
        assert math.isfinite(model.predict(shape)) and model.predict(shape) >= 0


def _best_face(matrix: list[list[float]], vector: list[float]) -> tuple[list[float], float]:
    """The non-negative minimum of x^T M x - 2 x^T v by comparing every face's value."""
    best, best_value = [0.0, 0.0, 0.0], 0.0
    for size in (1, 2, 3):
        for free in combinations(range(3), size):
            sub = _solve_linear([[matrix[i][j] for j in free] for i in free],
                                [vector[i] for i in free])
            if sub is None or any(v < 0 for v in sub):
                continue
            value = -sum(x * vector[i] for x, i in zip(sub, free, strict=True))
            if value < best_value:
                best, best_value = [0.0, 0.0, 0.0], value
                for x, i in zip(sub, free, strict=True):
                    best[i] = x
    return best, best_value


def test_the_non_negative_fit_is_the_best_of_every_face():
    """The fit stops at the first face meeting the KKT conditions (one or two solves
    instead of seven): that is the minimum every face's value would have chosen."""
    rng = random.Random(43)
    for _ in range(3000):
        rows = [[rng.gauss(0, 1) for _ in range(3)] for _ in range(4)]
        matrix = [[sum(r[i] * r[j] for r in rows) + (1e-3 if i == j else 0.0)
                   for j in range(3)] for i in range(3)]
        vector = [rng.gauss(0, 1) for _ in range(3)]
        fit = _nonnegative_quadratic_min(matrix, vector)
        best, _ = _best_face(matrix, vector)
        assert all(x >= 0 for x in fit)
        assert fit == pytest.approx(best, rel=1e-9, abs=1e-12)
