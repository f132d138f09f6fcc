"""Admission: a batch is refused unrun only on a prediction that measurements back.

A cold start whose first tiny batches ran slowly (a loaded host, a spare runtime
importing) once made the model predict 37 s for a 256-token text that takes 200 ms,
and every such request was refused: a refused request is never measured, so the
model could not learn it was wrong. These properties pin down what it may do instead.
"""

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from batching.latency_model import BatchShape, CostModel

# all-MiniLM-L6-v2's cpu profile (models/all-minilm-l6-v2.yaml): ~10 ms a batch.
SEED = (0.010136, 103.138e-6, 0.0)
ONE_LONG_TEXT = BatchShape(1, 256, 256)
DEFAULT_DEADLINE_S = 30.0


def _seed_seconds(shape: BatchShape) -> float:
    a, b, c = SEED
    tokens = shape.items * shape.longest
    return a + tokens * (b + c * shape.longest)


def _tiny_shape(draw_longest: int, draw_items: int) -> BatchShape:
    """A batch whose tokens x longest is at most 36, as a cold start's first are."""
    longest = draw_longest
    items = min(draw_items, 36 // longest**2)
    return BatchShape(items, longest, items * longest)


tiny_batches = st.lists(
    st.tuples(st.integers(1, 6), st.integers(1, 36), st.floats(0.040, 0.200)),
    min_size=5, max_size=12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tiny_batches)
def test_a_slow_cold_start_never_refuses_a_text_the_profile_serves(batches):
    model = CostModel(*SEED)
    for longest, items, seconds in batches:
        model.observe(_tiny_shape(longest, items), seconds)
    admission = model.admission(ONE_LONG_TEXT)
    assert admission.backing == 0  # nothing like it was measured ...
    assert admission.seconds <= _seed_seconds(ONE_LONG_TEXT)  # ... so the profile decides
    assert admission.seconds < DEFAULT_DEADLINE_S


def test_three_thousand_random_cold_starts_refuse_no_256_token_text():
    """The issue's figure: 152 of 3,000 predicted over 30 s before (192 with this seed)."""
    rng = random.Random(0)
    refused = predicted_over = 0
    for _ in range(3000):
        model = CostModel(*SEED)
        for _ in range(rng.randint(5, 12)):
            model.observe(_tiny_shape(rng.randint(1, 6), rng.randint(1, 36)),
                          rng.uniform(0.040, 0.200))
        refused += model.admission(ONE_LONG_TEXT).seconds > DEFAULT_DEADLINE_S
        predicted_over += model.predict(ONE_LONG_TEXT) > DEFAULT_DEADLINE_S
    assert (refused, predicted_over) == (0, 0)


measured_shapes = st.builds(BatchShape, st.integers(1, 64), st.integers(1, 512),
                            st.just(0))
times = st.floats(1e-4, 100.0)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(measured_shapes, times), max_size=40), measured_shapes)
def test_an_unbacked_refusal_rests_on_the_profile_whatever_was_measured(observed, shape):
    model = CostModel(*SEED)
    for measured, seconds in observed:
        model.observe(measured, seconds)
    admission = model.admission(shape)
    if admission.backing == 0:
        assert admission.seconds <= _seed_seconds(shape) * (1 + 1e-9)
    else:
        assert admission.backing >= 2 and admission.seconds == model.predict(shape)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(measured_shapes, times), min_size=1, max_size=40),
       measured_shapes)
def test_an_extrapolation_never_exceeds_four_times_the_scaled_seed(observed, shape):
    model = CostModel(*SEED)
    for measured, seconds in observed:
        model.observe(measured, seconds)
    tokens = [m.items * m.longest for m, _ in observed]
    products = [t * m.longest for t, (m, _) in zip(tokens, observed, strict=True)]
    t = shape.items * shape.longest
    if t > 2 * max(tokens) or t * shape.longest > 2 * max(products):
        assert model.predict(shape) <= 4 * model.level * _seed_seconds(shape) * (1 + 1e-9)


def _device(a_factor: float, b_factor: float, c_s: float):
    def seconds(shape: BatchShape) -> float:
        tokens = shape.items * shape.longest
        return SEED[0] * a_factor + tokens * (SEED[1] * b_factor + c_s * shape.longest)
    return seconds


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.floats(0.2, 20.0), st.floats(0.2, 20.0), st.sampled_from([0.0, 1e-9, 1e-8]),
       st.integers(0, 2**32 - 1))
def test_once_comparable_shapes_were_seen_predictions_stay_within_3x_of_the_device(
    a_factor, b_factor, c_s, rng_seed
):
    """Whatever the device (its overhead and per-token cost each 0.2-20x the profile's,
    with or without an attention term) and a random sequence of shapes with +-20%
    noise, a shape that two recent measured batches back is predicted within 3x."""
    rng = random.Random(rng_seed)
    device = _device(a_factor, b_factor, c_s)
    model = CostModel(*SEED)
    seen = []
    for _ in range(60):
        shape = BatchShape(rng.randint(1, 64), rng.choice([8, 16, 32, 64, 128, 256]), 0)
        model.observe(shape, device(shape) * rng.uniform(0.8, 1.2))
        seen.append(shape)
    for shape in seen[-20:]:
        admission = model.admission(shape)
        if admission.backing:
            ratio = admission.seconds / device(shape)
            assert 1 / 3 <= ratio <= 3, (shape, admission, device(shape))


def test_a_refusal_says_what_backs_it():
    model = CostModel(*SEED)
    assert "tuned profile" in model.admission(ONE_LONG_TEXT).describe()
    for _ in range(3):
        model.observe(ONE_LONG_TEXT, 0.2)
    admission = model.admission(ONE_LONG_TEXT)
    assert admission.backing == 3
    assert admission.describe() == "from 3 measured batches of a comparable shape"
    assert math.isclose(admission.seconds, model.predict(ONE_LONG_TEXT))


def test_measured_slowness_of_its_own_shape_backs_a_refusal():
    """A device really 100x slower than profiled for long texts: once measured, a
    request that cannot fit is refused on those measurements, not run again."""
    model = CostModel(*SEED)
    for _ in range(5):
        model.observe(ONE_LONG_TEXT, 40.0)
    admission = model.admission(ONE_LONG_TEXT)
    assert admission.backing == 5 and admission.seconds > DEFAULT_DEADLINE_S
