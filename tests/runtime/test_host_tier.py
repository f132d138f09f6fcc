"""The host-memory tier on the real runtime (issue 51): a model unloaded from the device
is kept in host memory while the budget allows, and loads again from there, giving the
very same outputs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runtimes.base import Request
from runtimes.child_side.host import ModelHost
from runtimes.model_files.footprint import tensor_bytes
from runtimes.pytorch import offload
from tasks.catalog import ModelEntry
from tests.tiny_encoders import build_tiny_colbert_st
from tests.tiny_lora import BERT_TARGETS, build_tiny_lora
from tests.tiny_models import build_tiny_sentence_transformer

TEXTS = ["The cat sits on the mat.", "", "Grüße aus Köln 東京 🚀", "long " * 40]
ONE = "test/tier-a"
TWO = "test/tier-b"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tier")
    one = build_tiny_sentence_transformer(root / "a", pooling="mean", normalize=True, seed=1)
    return {
        ONE: one,
        TWO: build_tiny_sentence_transformer(root / "b", pooling="cls", normalize=False, seed=2),
        "lora": build_tiny_lora(one, root / "a-lora", targets=BERT_TARGETS, seed=5),
    }


def entry(model: str, path: Path, **fields: Any) -> ModelEntry:
    return ModelEntry.model_validate({"id": model, "adapter": "dense", "dims": 32,
                                      "source": {"path": str(path)}, **fields})


def embed(host: ModelHost, model: str, **options: Any) -> bytes:
    kwargs: dict[str, Any] = {"items": [{"text": t} for t in TEXTS]}
    if options:
        kwargs["options"] = options
    (outcome,) = host.run_batch(model, [Request("r", "encode", {"model": model, **kwargs})])
    assert outcome.ok, outcome.error_message
    assert outcome.result is not None
    return outcome.result["embeddings"]


def test_a_reload_comes_from_host_memory_with_the_same_vectors(dirs, caplog):
    host = ModelHost(host_bytes=2**30)
    first = host.load_one(entry(ONE, dirs[ONE]))
    adapter = host.adapter(ONE)
    before = embed(host, ONE)
    host.unload(ONE)
    assert host.adapter(ONE) is None and ONE not in host.footprints
    assert host.tier.keys() == [ONE] and host.tier.used == tensor_bytes(adapter) > 0
    with caplog.at_level(logging.INFO, logger="runtimes.child_side.host"):
        again = host.load_one(entry(ONE, dirs[ONE]))
    assert host.adapter(ONE) is adapter  # not built again
    assert (host.tier.hits, len(host.tier), host.tier.used) == (1, 0, 0)
    assert again == first == host.footprints[ONE]
    assert any(f"loaded {ONE} from host memory" in r.getMessage() for r in caplog.records)
    assert embed(host, ONE) == before  # byte for byte


def test_a_budget_of_zero_builds_again(dirs):
    host = ModelHost()  # the default: no tier
    host.load_one(entry(ONE, dirs[ONE]))
    adapter = host.adapter(ONE)
    before = embed(host, ONE)
    host.unload(ONE)
    assert len(host.tier) == 0
    host.load_one(entry(ONE, dirs[ONE]))
    assert host.adapter(ONE) is not adapter and host.tier.hits == 0
    assert embed(host, ONE) == before


def test_a_model_larger_than_the_budget_is_not_kept(dirs):
    host = ModelHost(host_bytes=1024)
    host.load_one(entry(ONE, dirs[ONE]))
    adapter = host.adapter(ONE)
    host.unload(ONE)
    assert len(host.tier) == 0 and host.tier.used == 0 and host.tier.refused == 1
    host.load_one(entry(ONE, dirs[ONE]))
    assert host.adapter(ONE) is not adapter and host.tier.hits == 0


def test_the_least_recently_unloaded_goes_first(dirs):
    sizing = ModelHost()
    sizing.load_one(entry(ONE, dirs[ONE]))
    size = tensor_bytes(sizing.adapter(ONE))
    host = ModelHost(host_bytes=size + size // 2)  # room for one of the two (same size)
    host.load([entry(ONE, dirs[ONE]), entry(TWO, dirs[TWO])])
    two = host.adapter(TWO)
    host.unload(ONE)
    host.unload(TWO)
    assert host.tier.keys() == [TWO] and host.tier.evicted == 1
    host.load_one(entry(TWO, dirs[TWO]))
    assert host.adapter(TWO) is two and host.tier.hits == 1


def test_a_changed_entry_is_built_again(dirs):
    host = ModelHost(host_bytes=2**30)
    host.load_one(entry(ONE, dirs[ONE]))
    adapter = host.adapter(ONE)
    host.unload(ONE)
    host.load_one(entry(ONE, dirs[ONE], normalize=False))  # the catalog changed meanwhile
    assert host.adapter(ONE) is not adapter and len(host.tier) == 0


def test_lora_adapters_are_not_kept(dirs):
    host = ModelHost(host_bytes=2**30)
    model = entry(ONE, dirs[ONE], loras={"x": {"path": str(dirs["lora"])}})
    host.load_one(model)
    base = embed(host, ONE)
    host.load_lora(ONE, "x")
    assert embed(host, ONE, lora="x") != base
    host.unload(ONE)
    assert host.tier.keys() == [ONE] and set(host.footprints) == set()
    host.load_one(model)
    adapter = host.adapter(ONE)
    assert host.tier.hits == 1 and adapter is not None and adapter.loaded_loras == set()
    assert embed(host, ONE) == base
    host.load_lora(ONE, "x")  # loads again from its files
    assert "x" in adapter.loaded_loras


def test_the_walk_replaces_every_tensor_an_adapter_holds(dirs, tmp_path):
    """What moves on CUDA (`runtimes.pytorch.offload`), checked on the CPU with copies:
    every module's parameters (the same Parameter objects, new data) and the multivector
    projection's bare tensors (in frozen dataclasses) are replaced, and the outputs do not
    change."""
    path = build_tiny_colbert_st(tmp_path / "colbert")
    host = ModelHost()
    model = ModelEntry.model_validate({"id": "test/colbert", "adapter": "multivector",
                                       "dims": 16, "max_seq_length": 24,
                                       "source": {"path": str(path)}})
    host.load_one(model)
    adapter = host.adapter(model.id)
    before = embed(host, model.id)
    old = {id(t) for m in offload._walk(adapter, lambda t: t, offload.DEPTH, set())
           for t in (*m.parameters(), *m.buffers())}
    old_data = {t.data_ptr() for m in offload._walk(adapter, lambda t: t, offload.DEPTH, set())
                for t in m.parameters()}
    old_layers = [layer.weight for layer in adapter.layers]
    copies: list[torch.Tensor] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        copies.append(t.clone())
        return copies[-1]

    modules = offload._walk(adapter, copy, offload.DEPTH, set())
    assert modules
    params = [p for m in modules for p in m.parameters()]
    assert {id(p) for p in params} <= old  # the same parameters, new data
    assert not {p.data_ptr() for p in params} & old_data
    assert all(a is not b.weight for a, b in zip(old_layers, adapter.layers, strict=True))
    assert embed(host, model.id) == before
    assert np.isfinite(np.frombuffer(before, "<f4")).all()
