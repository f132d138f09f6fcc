"""Which number format a model runs in: the worker's override, the profile's, the device's."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from runtimes.model_files.precision import default_precision, device_kind, resolve_precision
from tasks.catalog import ModelEntry
from tasks.precision import CPU_PRECISIONS, PRECISIONS
from tasks.settings import Settings


def _entry(**profiles: dict[str, Any]) -> ModelEntry:
    return ModelEntry.model_validate({"id": "x/y", "adapter": "dense", "dims": 8,
                                      "source": {"hub": "x/y"}, "profiles": profiles})


def test_the_override_wins_over_the_profile():
    entry = _entry(cpu={"precision": "bf16"}, cuda={"precision": "fp16"})
    assert resolve_precision(entry, "cpu", "fp32") == "fp32"
    assert resolve_precision(entry, "cuda:0", "bf16") == "bf16"
    assert resolve_precision(entry, "cpu", "bf16", profile="cuda") == "bf16"


def test_the_profile_of_the_device_kind_decides_without_an_override():
    entry = _entry(cpu={"precision": "bf16"}, cuda={"precision": "fp16"},
                   h100={"precision": "bf16"})
    assert resolve_precision(entry, "cpu") == "bf16"
    assert resolve_precision(entry, "cpu", None) == "bf16"
    assert resolve_precision(entry, "cpu", "") == "bf16"  # an empty setting is no override
    # The profile is the device's kind ('cuda:1' -> 'cuda'), unless one is named.
    assert resolve_precision(entry, "cuda:1") == "fp16"
    assert resolve_precision(entry, " CUDA ") == "fp16"
    assert resolve_precision(entry, "cuda:1", profile="h100") == "bf16"


def test_cpu_defaults_to_fp32():
    assert default_precision("cpu") == "fp32"
    assert resolve_precision(_entry(), "cpu") == "fp32"
    assert resolve_precision(_entry(cpu={"max_items": 8}), "cpu") == "fp32"  # no precision
    # A profile of another device says nothing about the cpu.
    assert resolve_precision(_entry(cuda={"precision": "fp16"}), "cpu") == "fp32"


@pytest.mark.parametrize("override", ["fp8", "float16", "BF16", "int8"])
def test_an_unknown_override_is_refused_with_the_known_ones(override):
    with pytest.raises(ValueError) as err:
        resolve_precision(_entry(), "cpu", override)
    assert repr(override) in str(err.value)
    assert all(p in str(err.value) for p in PRECISIONS)


def test_device_kind_is_the_profile_key():
    assert [device_kind(d) for d in ("cpu", "cuda", "cuda:3", "CUDA:0", "mps")] == \
        ["cpu", "cuda", "cuda", "cuda", "mps"]


def test_the_cpu_formats_are_a_subset_without_fp16():
    assert set(CPU_PRECISIONS) < set(PRECISIONS) and "fp16" not in CPU_PRECISIONS


def test_the_worker_setting(monkeypatch):
    monkeypatch.delenv("SHOAL_PRECISION", raising=False)
    assert Settings().precision is None  # each entry's profile, else the device's default
    monkeypatch.setenv("SHOAL_PRECISION", "bf16")
    assert Settings().precision == "bf16"
    monkeypatch.setenv("SHOAL_PRECISION", "fp8")
    with pytest.raises(ValidationError, match="precision"):
        Settings()
