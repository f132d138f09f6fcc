"""The engine a device's profile chooses (`profiles.<device>.runtime`, written by `shoal
onboard` / `shoal tune`): which model it moves, what overrides it (SHOAL_RUNTIME, the
entry's own `runtime:`), what the catalog refuses, and the packaged MiniLM's choice."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.onboard.engine_choice import engine_candidates
from app.worker.runtime import runtime_of_models, worker_runtime
from runtimes.model_files.precision import resolve_precision
from tasks.catalog import ModelEntry, load_catalog
from tasks.settings import Settings

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _entry(adapter: str = "dense", **fields: Any) -> ModelEntry:
    body = {"id": f"x/{adapter}", "adapter": adapter, "source": {"hub": "x/y"}, **fields}
    if adapter in ("dense", "clip", "multivector"):
        body.setdefault("dims", 8)
    return ModelEntry.model_validate(body)


ON_ONNX = {"cpu": {"runtime": "onnx", "precision": "fp32"}}


def test_the_profile_of_the_device_at_hand_names_the_engine():
    entry = _entry(profiles=ON_ONNX)
    assert runtime_of_models([entry], None, "cpu") == {"x/dense": "onnx"}
    # No profile for a GPU: the default engine there.
    assert runtime_of_models([entry], None, "cuda:0") == {"x/dense": "pytorch"}
    # 'cuda:1' finds a `cuda` profile, as the batch limits and precision do.
    on_gpu = _entry(profiles={"cuda": {"runtime": "onnx"}})
    assert runtime_of_models([on_gpu], None, "cuda:1") == {"x/dense": "onnx"}


def test_an_entry_without_a_profile_stays_on_the_default_engine():
    assert runtime_of_models([_entry(), _entry("cross-encoder")], None, "cpu") == {
        "x/dense": "pytorch", "x/cross-encoder": "pytorch"}
    tuned_elsewise = _entry(profiles={"cpu": {"max_items": 8}})  # a profile naming no engine
    assert runtime_of_models([tuned_elsewise], None, "cpu") == {"x/dense": "pytorch"}


def test_shoal_runtime_overrides_the_profile(monkeypatch: pytest.MonkeyPatch):
    entry = _entry(profiles=ON_ONNX)
    monkeypatch.delenv("SHOAL_RUNTIME", raising=False)
    assert worker_runtime(Settings()) is None
    assert runtime_of_models([entry], worker_runtime(Settings()), "cpu") == {"x/dense": "onnx"}
    monkeypatch.setenv("SHOAL_RUNTIME", "pytorch")
    assert worker_runtime(Settings()) == "pytorch"
    assert runtime_of_models([entry], worker_runtime(Settings()), "cpu") == {
        "x/dense": "pytorch"}


def test_the_entry_s_own_runtime_overrides_the_profile():
    pinned = _entry(runtime="pytorch", profiles=ON_ONNX)
    assert runtime_of_models([pinned], None, "cpu") == {"x/dense": "pytorch"}
    # As before profiles chose: SHOAL_RUNTIME=onnx moves an entry of the default engine.
    assert runtime_of_models([pinned], "onnx", "cpu") == {"x/dense": "onnx"}
    on_onnx = _entry(runtime="onnx", profiles={"cpu": {"runtime": "pytorch"}})
    assert runtime_of_models([on_onnx], None, "cpu") == {"x/dense": "onnx"}


def test_a_profile_may_not_choose_onnx_for_loras_or_another_family():
    with pytest.raises(ValidationError, match=r"profiles.cpu.runtime: onnx serves no LoRA"):
        _entry(profiles=ON_ONNX, loras={"legal": {"path": "/models/legal"}})
    with pytest.raises(ValidationError, match=r"profiles.cpu.runtime: onnx serves the adapters"):
        _entry("clip", profiles=ON_ONNX)
    with pytest.raises(ValidationError, match="unknown runtime 'sim'"):
        _entry(profiles={"cpu": {"runtime": "sim"}})
    # Entries with LoRAs stay on PyTorch under SHOAL_RUNTIME=onnx too.
    lora = _entry(loras={"legal": {"path": "/models/legal"}})
    assert runtime_of_models([lora], "onnx", "cpu") == {"x/dense": "pytorch"}


def test_a_profile_s_precision_is_its_engine_s():
    assert _entry(profiles={"cpu": {"runtime": "onnx", "precision": "int8"}})
    with pytest.raises(ValidationError, match="int8 is not a format of runtime pytorch"):
        _entry(profiles={"cpu": {"runtime": "pytorch", "precision": "int8"}})
    # PyTorch serving such an entry (SHOAL_RUNTIME=pytorch) computes in its own default.
    int8 = _entry(profiles={"cpu": {"runtime": "onnx", "precision": "int8"}})
    assert resolve_precision(int8, "cpu") == "fp32"


def test_the_packaged_minilm_runs_on_onnx_fp32_on_a_cpu():
    entry = load_catalog().get(MINILM)
    assert entry is not None
    profile = entry.profile("cpu")
    assert profile is not None and (profile.runtime, profile.precision) == ("onnx", "fp32")
    assert runtime_of_models([entry], None, "cpu") == {MINILM: "onnx"}
    assert runtime_of_models([entry], "pytorch", "cpu") == {MINILM: "pytorch"}


def test_shoal_tune_tries_each_engine_that_can_serve_the_entry():
    assert engine_candidates(_entry(), "cpu") == [("pytorch", "fp32"), ("onnx", "fp32")]
    assert engine_candidates(_entry(profiles={"cpu": {"precision": "bf16"}}), "cpu") == [
        ("pytorch", "bf16"), ("onnx", "fp32")]
    assert engine_candidates(_entry(loras={"a": {"path": "/a"}}), "cpu") == [
        ("pytorch", "fp32")]
    assert engine_candidates(_entry("clip"), "cpu") == [("pytorch", "fp32")]
    assert engine_candidates(_entry(runtime="pytorch"), "cpu") == [("pytorch", "fp32")]
