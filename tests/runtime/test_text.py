"""Padding (runtimes.pytorch.text): the vectorised `pad` and `encoder_inputs` against a
straightforward per-row loop, for right and left padding and rows of every length."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from runtimes.pytorch.text import encoder_inputs, filled, pad, padded_chunks

ROWS = [[101, 7592, 102], [], [101, 102], [101, 2023, 2003, 1037, 2146, 6251, 102], [7]]
# Rows of ids as tokenizers give them, with the pad id itself inside some of them: the
# mask must come from the lengths, never from comparing ids with the pad id.
WITH_PAD_IDS = [[101, 0, 0, 102], [0], [101, 1, 102], []]


def reference_pad(rows: Sequence[Sequence[int]], value: int, left: bool = False) -> torch.Tensor:
    """One row at a time, as `pad` did before it was vectorised."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            if left:
                out[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            else:
                out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def _random_rows(seed: int, count: int = 40, longest: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 250_002, size=int(n)).tolist()
            for n in rng.integers(0, longest + 1, size=count)]


CASES = {
    "mixed": ROWS,
    "pad ids inside": WITH_PAD_IDS,
    "one row": [[5, 6, 7]],
    "one empty row": [[]],
    "all empty": [[], [], []],
    "no rows": [],
    "same length": [[1, 2], [3, 4], [5, 6]],
    "tuples": [(1, 2, 3), (4,), ()],
    "large ids": [[2**40, 250_001], [2**62]],
    "random": _random_rows(0),
    "random, long": _random_rows(1, count=7, longest=600),
}


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("value", [0, 1, -100])
@pytest.mark.parametrize("rows", list(CASES.values()), ids=list(CASES))
def test_pad_equals_the_per_row_loop(rows, value, left):
    ours = pad(rows, value, left=left)
    expected = reference_pad(rows, value, left)
    assert ours.dtype == torch.long and ours.shape == expected.shape
    assert torch.equal(ours, expected)


def test_pad_keeps_each_rows_tokens_in_order():
    right, left = pad(ROWS, -1), pad(ROWS, -1, left=True)
    assert right.shape == left.shape == (len(ROWS), 7)
    for i, row in enumerate(ROWS):
        assert right[i, : len(row)].tolist() == row and (right[i, len(row):] == -1).all()
        assert left[i, 7 - len(row):].tolist() == row and (left[i, : 7 - len(row)] == -1).all()


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("rows", list(CASES.values()), ids=list(CASES))
def test_filled_is_where_the_rows_are(rows, left):
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    mask = filled(lengths, left)
    assert mask.dtype == np.bool_
    assert np.array_equal(mask, reference_pad([[1] * len(r) for r in rows], 0, left).numpy())
    assert mask.sum(axis=1).tolist() == lengths.tolist()


@pytest.mark.parametrize("pad_id", [0, 1])
@pytest.mark.parametrize("rows", [ROWS, WITH_PAD_IDS, _random_rows(2)],
                         ids=["mixed", "pad ids inside", "random"])
def test_encoder_inputs_match_the_per_row_loop(rows, pad_id):
    types = [[i % 2] * len(r) for i, r in enumerate(rows)]  # a pair's second text is 1s
    inputs = encoder_inputs(rows, types, pad_id, "cpu")
    assert set(inputs) == {"input_ids", "attention_mask", "token_type_ids"}
    assert torch.equal(inputs["input_ids"], reference_pad(rows, pad_id))
    assert torch.equal(inputs["attention_mask"], reference_pad([[1] * len(r) for r in rows], 0))
    assert torch.equal(inputs["token_type_ids"], reference_pad(types, 0))
    for tensor in inputs.values():
        assert tensor.dtype == torch.long and tensor.device.type == "cpu"
        assert tensor.shape == (len(rows), max(len(r) for r in rows))
    # The mask counts each row's own tokens, pad ids among them included.
    assert inputs["attention_mask"].sum(dim=1).tolist() == [len(r) for r in rows]


def test_encoder_inputs_without_token_types():
    inputs = encoder_inputs(ROWS, None, 0, "cpu")
    assert set(inputs) == {"input_ids", "attention_mask"}
    assert torch.equal(inputs["input_ids"], reference_pad(ROWS, 0))
    assert torch.equal(inputs["attention_mask"], reference_pad([[1] * len(r) for r in ROWS], 0))


def test_encoder_inputs_feed_a_model_like_the_tokenizers_padding():
    """The same tensors the tokenizer's own padding gives (BERT pads on the right)."""
    from transformers import AutoTokenizer

    from tests.tiny_models import MINILM_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    texts = ["hello", "", "a somewhat longer text, with punctuation!", "Grüße 東京"]
    plain = tokenizer(texts)
    inputs = encoder_inputs(plain["input_ids"], plain["token_type_ids"],
                            tokenizer.pad_token_id, "cpu")
    padded = tokenizer(texts, padding=True, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(inputs[key], padded[key]), key


@pytest.mark.parametrize("multiple", [1, 8, 16])
def test_a_width_multiple_rounds_the_padded_width_up_and_masks_the_rest(multiple):
    rows = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    chunks = list(padded_chunks(rows, None, 0, "cpu", 10_000, multiple))
    assert len(chunks) == 1
    inputs = chunks[0][1]
    width = -(-5 // multiple) * multiple
    assert inputs["input_ids"].shape == (3, width)
    assert inputs["attention_mask"].sum(dim=1).tolist() == [1, 3, 5]  # length-sorted
    assert pad(rows, 0, left=True, multiple=multiple)[:, -5:].tolist()[2] == rows[2]
