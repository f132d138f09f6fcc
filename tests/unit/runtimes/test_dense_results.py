"""A batch's dense results computed per unit of equal options
(`runtimes.families.vectors.dense_results`) are, byte for byte, what `dense_result` gives
each request on its own rows: for any mix of dimensions, normalisation and dtype, in any
order, one-text and many-text requests together."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runtimes.families.vectors import dense_result, dense_results
from tasks.options import EncodeOptions
from tasks.schema import Item, ParsedRequest

DIMS = 384  # MiniLM's width: the rows' reductions run over as many values as in serving
OPTIONS = st.builds(
    EncodeOptions,
    normalize=st.sampled_from([None, True, False]),
    dimensions=st.sampled_from([None, 1, 7, 8, 64, DIMS]),
    dtype=st.sampled_from(["float32", "float16", "int8", "binary"]),
)
REQUEST = st.tuples(st.integers(0, 4), OPTIONS)  # (its items, its options)


def one_by_one(prepared: list[ParsedRequest], vectors: np.ndarray,
               input_ids: list[list[int]], normalize_default: bool) -> list[dict]:
    """Each request's result from its own rows: what dense_results gave before units."""
    results, offset = [], 0
    for parsed in prepared:
        n = len(parsed.items)
        used = sum(len(ids) for ids in input_ids[offset:offset + n])
        results.append(dense_result(vectors[offset:offset + n], parsed.options,
                                    normalize_default, used))
        offset += n
    return results


def batch(requests: list[tuple[int, EncodeOptions]], seed: int
          ) -> tuple[list[ParsedRequest], np.ndarray, list[list[int]]]:
    rng = np.random.default_rng(seed)
    prepared = [ParsedRequest("encode", [Item(text="x")] * n, options)
                for n, options in requests]
    rows = sum(n for n, _ in requests)
    # Pooled vectors of mixed scales, some rows zero (their norm is clamped).
    vectors = (rng.standard_normal((rows, DIMS)) * rng.uniform(1e-3, 50, (rows, 1))
               ).astype(np.float32)
    vectors[rng.random(rows) < 0.1] = 0.0
    input_ids = [list(range(int(k))) for k in rng.integers(1, 40, rows)]
    return prepared, vectors, input_ids


@settings(max_examples=300, deadline=None)
@given(st.lists(REQUEST, min_size=1, max_size=40), st.booleans(), st.integers(0, 2**32 - 1))
def test_units_give_each_request_its_own_bytes(requests, normalize_default, seed):
    prepared, vectors, input_ids = batch(requests, seed)
    assert dense_results(prepared, vectors, input_ids, normalize_default) == \
        one_by_one(prepared, vectors, input_ids, normalize_default)


def test_a_coalesced_batch_of_mixed_options_keeps_every_requests_bytes():
    """The case the units are for, spelled out: 24 one-text requests (interleaved options,
    so a unit's rows are not one run) and a 5-text request among them."""
    cycle = [EncodeOptions(), EncodeOptions(dimensions=8), EncodeOptions(dtype="int8"),
             EncodeOptions(normalize=False, dtype="float16"), EncodeOptions(dtype="binary")]
    requests = [(1, cycle[i % len(cycle)]) for i in range(24)]
    requests.insert(7, (5, EncodeOptions()))
    prepared, vectors, input_ids = batch(requests, seed=43)
    got = dense_results(prepared, vectors, input_ids, True)
    assert got == one_by_one(prepared, vectors, input_ids, True)
    assert [r["count"] for r in got] == [n for n, _ in requests]
    assert all(type(r["embeddings"]) is bytes for r in got)
