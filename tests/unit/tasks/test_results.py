"""Reading results without numpy: every dtype and layout the runtimes write."""

from __future__ import annotations

import numpy as np
import pytest

from runtimes.families.vectors import dense_result, quantize
from tasks.options import EncodeOptions
from tasks.results import embedding_rows, multivector_rows, ranked, row_width

ROWS = np.array([[0.5, -0.25, 0.0, 1.0, -2.0, 0.125, 3.0, -0.5, 0.75],
                 [-1.0, 1.0, 0.5, -0.5, 0.25, 0.0, -3.0, 2.0, 1.5]], dtype=np.float32)


def _result(dtype: str) -> dict:
    return {"dims": ROWS.shape[1], "count": 2, "dtype": dtype,
            "embeddings": quantize(ROWS, dtype)}


@pytest.mark.parametrize("dtype,tolerance", [("float32", 0), ("float16", 1e-3)])
def test_float_rows_read_back(dtype, tolerance):
    np.testing.assert_allclose(embedding_rows(_result(dtype)), ROWS, atol=tolerance)


def test_int8_keeps_each_rows_direction():
    rows = np.array(embedding_rows(_result("int8")), dtype=np.float32)
    assert rows.dtype == np.float32 and np.abs(rows).max(axis=1).tolist() == [127, 127]
    cosines = (rows * ROWS).sum(1) / np.linalg.norm(rows, axis=1) / np.linalg.norm(ROWS, axis=1)
    assert cosines.min() > 0.999


def test_binary_is_sign_bits_packed_high_bit_first():
    rows = embedding_rows(_result("binary"))
    assert row_width(9, "binary") == 2 and len(rows[0]) == 2
    bits = np.unpackbits(np.array(rows, dtype=np.uint8), axis=1)[:, :9]
    assert bits.tolist() == (ROWS > 0).astype(int).tolist()


def test_dense_result_truncates_then_normalises():
    result = dense_result(ROWS, EncodeOptions(dimensions=4), True, tokens=7)
    rows = np.array(embedding_rows(result))
    assert result["dims"] == 4 and result["usage"] == {"tokens": 7}
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-6)
    raw = dense_result(ROWS, EncodeOptions(normalize=False), True, tokens=7)
    np.testing.assert_allclose(embedding_rows(raw), ROWS)


def test_multivector_rows_split_by_lengths():
    vectors = np.arange(5 * 3, dtype="<f4").reshape(5, 3)
    result = {"dims": 3, "lengths": [2, 0, 3], "embeddings": vectors.tobytes()}
    items = multivector_rows(result)
    assert [len(i) for i in items] == [2, 0, 3]
    assert items[2][0] == vectors[2].tolist()


def test_ranked_is_best_first_with_original_index():
    result = {"scores": [0.1, 0.9, 0.5, 0.9]}
    assert ranked(result) == [
        {"index": 1, "score": 0.9, "rank": 1}, {"index": 3, "score": 0.9, "rank": 2},
        {"index": 2, "score": 0.5, "rank": 3}, {"index": 0, "score": 0.1, "rank": 4},
    ]
    assert [r["index"] for r in ranked(result, top_n=2)] == [1, 3]
