"""bench.onnx_inprocess' pure logic: engine order, batches, queries, retrieval figures,
medians and ratios, the table and the verdicts. No model is loaded and nothing is timed."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench import onnx_inprocess as oi


def test_order_rotates_so_each_engine_leads_once_in_three_rounds() -> None:
    firsts = [oi.order(r)[0] for r in range(3)]
    assert sorted(firsts) == sorted(oi.ENGINES)
    assert all(sorted(oi.order(r)) == sorted(oi.ENGINES) for r in range(5))


def test_batches_cover_every_text_in_full_batches() -> None:
    cut = oi.batches([f"t{i}" for i in range(10)], 4)
    assert [len(b) for b in cut] == [4, 4, 4]
    assert cut[2] == ["t8", "t9", "t0", "t1"]
    assert oi.batches(["a"], 1) == [["a"]]


def test_shorten_keeps_about_half_the_words() -> None:
    rng = random.Random(0)
    query = oi.shorten("Alpha beta gamma delta epsilon zeta.", rng)
    words = query.split()
    assert len(words) == 3 and set(words) <= {"alpha", "beta", "gamma", "delta", "epsilon",
                                              "zeta"}
    assert len(oi.shorten("One two.", rng).split()) == 2


def test_top_k_overlap_and_recall() -> None:
    corpus = np.eye(4, dtype=np.float32)
    queries = np.array([[1, 0.5, 0, 0], [0, 0, 0.2, 1]], dtype=np.float32)
    top = oi.top_k(queries, corpus, k=2)
    assert top.tolist() == [[0, 1], [3, 2]]
    assert oi.recall_at_k(top, [1, 0]) == 0.5
    assert oi.overlap_at_k(top, np.array([[1, 0], [3, 0]])) == 0.75
    assert oi.cosines(corpus, corpus * 2) == pytest.approx([1, 1, 1, 1])


def _runs() -> list[dict]:
    rates = {"pytorch": {1: 100.0, 32: 300.0}, "ort-fp32": {1: 200.0, 32: 450.0},
             "ort-int8": {1: 400.0, 32: 900.0}}
    return [{"round": r, "batch": b, "engine": e, "texts_per_s": rate * (1 + 0.1 * r)}
            for r in range(3) for e, by in rates.items() for b, rate in by.items()]


def test_summarise_medians_and_ratios_to_pytorch() -> None:
    summary = oi.summarise(_runs())
    one, big = summary["rows"]
    assert summary["pytorch_best"] == pytest.approx(330.0)
    assert big["ort-int8_texts_per_s"] == pytest.approx(990.0)
    assert one["ort-fp32_vs_pytorch"] == pytest.approx(2.0)
    assert big["ort-int8_vs_pytorch_best"] == pytest.approx(3.0)
    assert summary["best_vs_pytorch_best"]["ort-fp32"] == pytest.approx(1.5)


def test_table_and_verdicts() -> None:
    summary = oi.summarise(_runs())
    lines = oi.table(summary).splitlines()
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[3].startswith("| 32 | 330 | 495 | 990 |")
    quality = {"int8_overlap_at_10": 0.97, "fp32_recall_at_10": 0.93,
               "int8_recall_at_10": 0.91}
    verdicts = oi.verdicts(summary, quality)
    assert verdicts[0].endswith(": met") and "1.50x" in verdicts[0]
    assert verdicts[1].endswith(": met")
    assert verdicts[2].endswith("NOT met")  # overlap 0.97 < 0.98
    assert verdicts[3].endswith(": met")  # a drop of exactly 0.02


def test_parse_args() -> None:
    args = oi.parse_args([])
    assert (args.batches, args.rounds, args.threads, args.texts) == ([1, 8, 32, 128], 3, 2, 256)
    with pytest.raises(SystemExit):
        oi.parse_args(["--rounds", "0"])
