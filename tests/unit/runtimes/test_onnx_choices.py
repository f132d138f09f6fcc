"""What the catalog and the worker decide about ONNX Runtime: which entries may say
`runtime: onnx`, in which formats, and which runtime serves each model of a worker."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.worker.runtime import runtime_of_models
from runtimes.onnx.engine import OnnxEngine
from tasks.catalog import ModelEntry
from tasks.engines import engine


def _entry(adapter: str = "dense", **fields: Any) -> ModelEntry:
    body = {"id": f"x/{adapter}", "adapter": adapter, "source": {"hub": "x/y"}, **fields}
    if adapter in ("dense", "clip", "multivector"):
        body.setdefault("dims", 8)
    return ModelEntry.model_validate(body)


@pytest.mark.parametrize("adapter", sorted(engine("onnx").families))
def test_the_text_encoders_may_say_runtime_onnx(adapter):
    assert _entry(adapter, runtime="onnx").runtime == "onnx"


@pytest.mark.parametrize("adapter", ["clip", "causal-lm", "multivector"])
def test_other_families_may_not(adapter):
    with pytest.raises(ValidationError, match=r"cannot run on onnx.*runtime: pytorch"):
        _entry(adapter, runtime="onnx")


def test_loras_on_onnx_are_refused_naming_the_pytorch_runtime():
    with pytest.raises(ValidationError, match=r"no LoRA adapters.*runtime: pytorch"):
        _entry(runtime="onnx", loras={"legal": {"path": "/models/legal"}})


def test_formats_are_checked_per_runtime():
    assert _entry(runtime="onnx", profiles={"cpu": {"precision": "int8"}})
    with pytest.raises(ValidationError, match="int8 is not a format of runtime pytorch"):
        _entry(profiles={"cpu": {"precision": "int8"}})
    with pytest.raises(ValidationError, match="bf16 is not a format of runtime onnx"):
        _entry(runtime="onnx", profiles={"cuda": {"precision": "bf16"}})
    with pytest.raises(ValidationError, match="fp16 is not served on a CPU"):
        _entry(runtime="onnx", profiles={"cpu": {"precision": "fp16"}})


def test_the_onnx_engine_picks_the_override_then_the_profile_then_the_device():
    cpu, cuda = OnnxEngine("cpu"), OnnxEngine("cuda:0")
    plain = _entry()
    assert (cpu.precision(plain, None), cuda.precision(plain, None)) == ("fp32", "fp16")
    assert cpu.precision(_entry(runtime="onnx", profiles={"cpu": {"precision": "int8"}}),
                         None) == "int8"
    assert cpu.precision(plain, "int8") == "int8"
    # A PyTorch entry's bf16 (moved here by SHOAL_RUNTIME=onnx) is not ONNX's: the default.
    assert cpu.precision(_entry(profiles={"cpu": {"precision": "bf16"}}), None) == "fp32"
    with pytest.raises(ValueError, match="computes in"):
        cpu.precision(plain, "fp16")


def test_shoal_runtime_onnx_moves_the_encoders_without_loras():
    entries = [_entry("dense"), _entry("cross-encoder"), _entry("clip"),
               _entry("causal-lm"),
               ModelEntry.model_validate({"id": "x/with-lora", "adapter": "dense", "dims": 8,
                                          "source": {"hub": "x/y"},
                                          "loras": {"a": {"path": "/a"}}})]
    assert runtime_of_models(entries, "onnx") == {
        "x/dense": "onnx", "x/cross-encoder": "onnx", "x/clip": "pytorch",
        "x/causal-lm": "pytorch", "x/with-lora": "pytorch"}
    assert set(runtime_of_models(entries, "pytorch").values()) == {"pytorch"}
    assert runtime_of_models([_entry(runtime="onnx")], "pytorch") == {"x/dense": "onnx"}
