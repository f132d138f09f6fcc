"""Bucketed shapes (and, on a GPU, CUDA graphs) give every encoder family the outputs of
its plain forward pass: `runtimes.pytorch.buckets`.

Each family's tiny model is loaded twice, with SHOAL_CUDA_GRAPHS=buckets (padding forced
on, here on the CPU) and =off, and the family's own forward loop (what its adapter runs)
is compared on the same tokens: mixed lengths, row counts that are and are not bucket
sizes, and chunks no bucket holds (a small padded-token budget), which run as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runtimes.child_side.host import ModelHost
from runtimes.pytorch import buckets
from runtimes.pytorch.buckets import ROWS, Buckets, Plan, all_buckets, bucket_for, plan, widths
from tasks.catalog import ModelEntry
from tests.tiny_classifiers import build_tiny_cross_encoder, build_tiny_ner
from tests.tiny_encoders import build_tiny_colbert_st, build_tiny_splade
from tests.tiny_lora import BERT_TARGETS, build_tiny_lora
from tests.tiny_models import build_tiny_sentence_transformer

WORDS = ("the", "cat", "sat", "on", "a", "mat", "while", "rivers", "of", "france", "ran", "to",
         "the", "sea", "under", "grey", "skies")
# Row counts: bucket sizes (1, 4, 16) and not (3, 5, 13, 37); lengths from 1 word to
# past the tiny models' 128 positions (truncated).
ROW_COUNTS = (1, 3, 4, 5, 13, 16, 37)


def _texts(rows: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed + rows)
    lengths = rng.integers(1, 40, rows)
    if rows > 2:
        lengths[rows // 2] = 150  # one past the limit: truncated, the widest bucket
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
            for i, n in enumerate(lengths)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return (a * b).sum(axis=-1)


def _host(monkeypatch: pytest.MonkeyPatch, mode: str, entry: dict[str, Any],
          chunk_tokens: int = 16_384, device: str = "cpu") -> ModelHost:
    monkeypatch.setenv(buckets.ENV, mode)
    host = ModelHost(device=device, chunk_tokens=chunk_tokens)
    host.load([ModelEntry.model_validate(entry)])
    monkeypatch.delenv(buckets.ENV)
    return host


def _pair(monkeypatch: pytest.MonkeyPatch, entry: dict[str, Any], chunk_tokens: int = 16_384,
          device: str = "cpu", mode: str = "buckets") -> tuple[Any, Any]:
    """The adapter of `entry` loaded bucketed (`mode`) and plain."""
    on = _host(monkeypatch, mode, entry, chunk_tokens, device).adapter(entry["id"])
    off = _host(monkeypatch, "off", entry, chunk_tokens, device).adapter(entry["id"])
    return on, off


def _runner(model: torch.nn.Module) -> Buckets:
    runner = buckets.buckets_of(model)
    assert runner is not None
    return runner


# --- the bucket choice and the setting ---------------------------------------------------------


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_batch():
    assert bucket_for(1, 1, 128, 16_384) == (1, 16)
    assert bucket_for(3, 17, 128, 16_384) == (4, 32)
    assert bucket_for(256, 32, 512, 16_384) == (256, 32)
    assert bucket_for(257, 32, 512, 16_384) == (384, 32)
    assert bucket_for(9, 100, 512, 16_384) == (12, 128)
    assert bucket_for(5, 120, 128, 16_384) == (8, 128)


def test_bucket_for_gives_none_outside_the_buckets():
    assert bucket_for(ROWS[-1] + 1, 16, 512, 1 << 30) is None  # more rows than any bucket
    assert bucket_for(1, 1025, 2048, 1 << 30) is None  # wider than the widest
    assert bucket_for(100, 200, 512, 16_384) is None  # 128 x 256 is past the budget
    assert bucket_for(0, 16, 512, 16_384) is None


def test_widths_stop_at_the_models_limit():
    assert widths(128) == (16, 32, 48, 64, 96, 128)
    assert widths(200) == (16, 32, 48, 64, 96, 128, 192, 200)
    assert widths(8) == (8,)
    assert widths(8192)[-1] == 1024


def test_buckets_stay_few_and_within_the_budget():
    every = all_buckets(512, 16_384)
    assert len(every) <= 130
    assert all(r * w <= 16_384 for r, w in every)
    assert (256, 32) in every and (32, 512) in every and (1024, 16) in every


def test_the_setting():
    assert plan("auto", "cpu") == Plan(False, False)
    assert plan("auto", "cuda:0") == Plan(True, True)
    assert plan("on", "cpu") == Plan(True, False)
    assert plan("buckets", "cuda") == Plan(True, False)
    assert plan("off", "cuda") == Plan(False, False)
    assert plan("auto", "cuda", replaced_forward=True) == Plan(False, False)
    assert plan("on", "cuda", replaced_forward=True) == Plan(True, False)


def test_the_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(buckets.ENV, raising=False)
    assert buckets.configured_mode() == "auto"
    for value, mode in (("OFF", "off"), ("0", "off"), ("buckets", "buckets"), ("1", "on")):
        monkeypatch.setenv(buckets.ENV, value)
        assert buckets.configured_mode() == mode
    monkeypatch.setenv(buckets.ENV, "sometimes")
    with pytest.raises(ValueError, match=buckets.ENV):
        buckets.configured_mode()


def test_fill_pads_columns_and_adds_one_token_dummy_rows():
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
              "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    target = {k: torch.full((4, 5), -1) for k in inputs}
    buckets.fill(target, inputs, pad_id=0)
    assert target["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [0] * 5, [0] * 5]
    assert target["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0],
                                                 [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]


# --- no graphs without CUDA ------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_sentence_transformer(tmp_path_factory.mktemp("buckets") / "dense",
                                           pooling="mean", normalize=True)


def _dense_entry(path: Path, loras: dict[str, Path] | None = None) -> dict[str, Any]:
    return {"id": "test/tiny-dense", "adapter": "dense", "dims": 32,
            "source": {"path": str(path)},
            "loras": {n: {"path": str(p)} for n, p in (loras or {}).items()}}


def test_no_graph_is_captured_without_cuda(monkeypatch, dense_dir):
    def no_cuda(*_: Any, **__: Any) -> None:
        raise AssertionError("a CUDA graph call on a CPU host")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", no_cuda)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_cuda)
    # Asked for graphs on a CPU: buckets only, even when the plan is forced.
    adapter = _host(monkeypatch, "on", _dense_entry(dense_dir)).adapter("test/tiny-dense")
    runner = _runner(adapter.encoder.model)
    assert runner.plan == Plan(True, False) and not runner.graphs
    forced = Buckets(field="last_hidden_state", device="cpu", pad_id=0, limit=128,
                     max_tokens=1024, inputs=("input_ids", "attention_mask"),
                     plan=Plan(True, True))
    forced.capture(adapter.encoder.model, "test")
    assert not forced.graphs and forced.graph_bytes == 0
    encoder = adapter.encoder
    encoder.embed(encoder.tokenize(_texts(5)))
    assert runner.replays == 0 and runner.padded == 1


def test_auto_on_a_cpu_leaves_the_model_alone(monkeypatch, dense_dir):
    adapter = _host(monkeypatch, "auto", _dense_entry(dense_dir)).adapter("test/tiny-dense")
    assert buckets.buckets_of(adapter.encoder.model) is None


# --- every family: bucketed = plain ----------------------------------------------------------


def _check_dense(on: Any, off: Any, loras: Callable[[int], list[str | None]] | None = None
                 ) -> None:
    for rows in ROW_COUNTS:
        texts = _texts(rows)
        names = None if loras is None else loras(rows)
        tokens = on.encoder.tokenize(texts)
        a = on.encoder.embed(tokens, names)
        b = off.encoder.embed(tokens, names)
        assert _cosines(a, b).min() >= 0.9999, rows
        np.testing.assert_allclose(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1),
                                   rtol=1e-4)


def test_dense(monkeypatch, dense_dir):
    on, off = _pair(monkeypatch, _dense_entry(dense_dir))
    _check_dense(on, off)
    runner = _runner(on.encoder.model)
    assert runner.padded == len(ROW_COUNTS) and runner.unbucketed == 0
    assert buckets.buckets_of(off.encoder.model) is None


def test_dense_with_a_lora_mix(monkeypatch, dense_dir, tmp_path):
    loras = {name: build_tiny_lora(dense_dir, tmp_path / name, targets=BERT_TARGETS,
                                   seed=100 + i) for i, name in enumerate(("alpha", "beta"))}
    on, off = _pair(monkeypatch, _dense_entry(dense_dir, loras))
    for adapter in (on, off):
        for name, path in loras.items():
            adapter.load_lora(name, str(path))
    cycle = [None, "alpha", "beta", "alpha", None]
    _check_dense(on, off, lambda rows: [cycle[i % len(cycle)] for i in range(rows)])
    # Base rows only, with LoRAs loaded: padded as well.
    _check_dense(on, off, lambda rows: [None] * rows)
    # The LoRAs do change the vectors: the mix is not the base model's.
    tokens = on.encoder.tokenize(_texts(5))
    assert _cosines(on.encoder.embed(tokens, ["alpha"] * 5),
                    on.encoder.embed(tokens)).min() < 0.999
    assert _runner(on.encoder.model).padded >= 2 * len(ROW_COUNTS)


def test_dense_outside_the_buckets_runs_as_it_is(monkeypatch, dense_dir):
    # A 64-token budget: most chunks fit a bucket once rounded up, some do not.
    on, off = _pair(monkeypatch, _dense_entry(dense_dir), chunk_tokens=64)
    _check_dense(on, off)
    runner = _runner(on.encoder.model)
    assert runner.padded > 0 and runner.unbucketed > 0
    # More rows than the largest bucket (a budget that lets them through).
    on, off = _pair(monkeypatch, _dense_entry(dense_dir), chunk_tokens=1 << 20)
    tokens = on.encoder.tokenize(["a b"] * (ROWS[-1] + 3))
    assert _cosines(on.encoder.embed(tokens), off.encoder.embed(tokens)).min() >= 0.9999
    assert _runner(on.encoder.model).unbucketed == 1


def test_sparse(monkeypatch, tmp_path):
    path = build_tiny_splade(tmp_path / "splade")
    on, off = _pair(monkeypatch, {"id": "test/tiny-splade", "adapter": "sparse",
                                  "source": {"path": str(path)}})
    for rows in ROW_COUNTS:
        encoded = on.tokenizer(_texts(rows), truncation=True, max_length=on.max_seq_length)
        types = encoded.get("token_type_ids")
        a = on.embed(encoded["input_ids"], types)
        b = off.embed(encoded["input_ids"], types)
        for x, y in zip(a, b, strict=True):
            assert x["indices"] == y["indices"]
            np.testing.assert_allclose(x["values"], y["values"], rtol=1e-4, atol=1e-5)
    assert _runner(on.model).padded >= len(ROW_COUNTS) and _runner(on.model).unbucketed == 0


def test_multivector(monkeypatch, tmp_path):
    path = build_tiny_colbert_st(tmp_path / "colbert", dims=16)
    on, off = _pair(monkeypatch, {"id": "test/tiny-colbert", "adapter": "multivector",
                                  "dims": 16, "source": {"path": str(path)}})
    for rows in ROW_COUNTS:
        encoded = on.tokenizer(_texts(rows), truncation=True,
                               max_length=on.document_length - 3)
        # Every other row ends in [MASK] expansion that is not attended to: masked places
        # inside a row's own width.
        ids, types, attention = [], [], []
        for i, row in enumerate(encoded["input_ids"]):
            extra = 3 * (i % 2)
            ids.append(list(row) + [on.expansion_id] * extra)
            types.append([0] * (len(row) + extra))
            attention.append([1] * len(row) + [0] * extra)
        a = on._embed(ids, types, attention)
        b = off._embed(ids, types, attention)
        for x, y in zip(a, b, strict=True):
            assert x.shape == y.shape
            assert _cosines(x, y).min() >= 0.9999
    assert _runner(on.model).padded >= len(ROW_COUNTS) and _runner(on.model).unbucketed == 0


@pytest.mark.parametrize("adapter", ["cross-encoder", "sequence-classification"])
def test_sequence_classification(monkeypatch, tmp_path, adapter):
    path = build_tiny_cross_encoder(tmp_path / "classifier", num_labels=3)
    on, off = _pair(monkeypatch, {"id": "test/tiny-classifier", "adapter": adapter,
                                  "source": {"path": str(path)}})
    for rows in ROW_COUNTS:
        texts = _texts(rows)
        tokens = on.classifier.tokenize(texts, texts[::-1], truncation="longest_first")
        np.testing.assert_allclose(on.classifier.logits(tokens), off.classifier.logits(tokens),
                                   rtol=1e-4, atol=1e-5)
    assert _runner(on.classifier.model).padded >= len(ROW_COUNTS)


@pytest.mark.parametrize("architecture", ["bert", "xlm-roberta"])
def test_token_classification(monkeypatch, tmp_path, architecture):
    path = build_tiny_ner(tmp_path / "ner", architecture)
    on, off = _pair(monkeypatch, {"id": "test/tiny-ner", "adapter": "token-classification",
                                  "source": {"path": str(path)}})
    for rows in ROW_COUNTS:
        encoded = on.tokenizer(_texts(rows), truncation=True, max_length=on.max_length)
        types = encoded.get("token_type_ids")
        a = on.probabilities(encoded["input_ids"], types)
        b = off.probabilities(encoded["input_ids"], types)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    assert _runner(on.model).padded >= len(ROW_COUNTS) and _runner(on.model).unbucketed == 0


def test_an_emulated_device_sees_the_bucket(monkeypatch, dense_dir):
    from runtimes.doubles import emulated

    monkeypatch.setenv(emulated.ENV, "0,0")
    emulated.reset()
    try:
        adapter = _host(monkeypatch, "buckets", _dense_entry(dense_dir)).adapter(
            "test/tiny-dense")
        runner = _runner(adapter.encoder.model)
        assert not runner.graphs
        encoder = adapter.encoder
        tokens = encoder.tokenize(["a b c"] * 5)  # 5 rows x 5 tokens: the (8, 16) bucket
        assert encoder.embed(tokens).shape == (5, 32)
        assert emulated.totals().padded_tokens == 8 * 16
    finally:
        monkeypatch.delenv(emulated.ENV)
        emulated.reset()


# --- CUDA: captured graphs replay what eager computes ----------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graphs_replay_what_eager_computes(monkeypatch, dense_dir):
    on, off = _pair(monkeypatch, _dense_entry(dense_dir), device="cuda", mode="auto")
    runner = _runner(on.encoder.model)
    assert runner.plan == Plan(True, True) and runner.graphs and runner.graph_bytes > 0
    _check_dense(on, off)
    assert runner.replays >= len(ROW_COUNTS) and runner.padded == 0


@cuda
def test_cuda_graphs_keep_batches_in_flight_apart(monkeypatch, dense_dir):
    """Two batches queued before either is read back (the pipeline's order), through
    the same and through different buckets, several chunks each."""
    on, off = _pair(monkeypatch, _dense_entry(dense_dir), chunk_tokens=256, device="cuda",
                    mode="auto")
    encoder = on.encoder
    batches = [encoder.tokenize(_texts(rows, seed)) for rows, seed in
               ((13, 0), (13, 1), (5, 2), (37, 3))]
    planned = [encoder.chunks(t) for t in batches]
    copies = [encoder.forward(chunks) for chunks in planned]
    for tokens, chunks, copy in zip(batches, planned, copies, strict=True):
        ours = encoder.gather(chunks, copy, len(tokens.input_ids))
        assert _cosines(ours, off.encoder.embed(tokens)).min() >= 0.9999
    assert _runner(encoder.model).replays > len(batches)


@cuda
def test_cuda_graphs_serve_base_rows_beside_lora_rows(monkeypatch, dense_dir, tmp_path):
    lora = build_tiny_lora(dense_dir, tmp_path / "alpha", targets=BERT_TARGETS, seed=100)
    on, off = _pair(monkeypatch, _dense_entry(dense_dir, {"alpha": lora}), device="cuda",
                    mode="auto")
    for adapter in (on, off):
        adapter.load_lora("alpha", str(lora))
    runner = _runner(on.encoder.model)
    _check_dense(on, off, lambda rows: [None] * rows)  # replayed: base rows only
    replays = runner.replays
    assert replays >= len(ROW_COUNTS)
    _check_dense(on, off, lambda rows: ["alpha" if i % 2 else None for i in range(rows)])
    assert runner.padded >= len(ROW_COUNTS) - 1  # one row of 1: no LoRA row in it
