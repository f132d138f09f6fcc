"""The engine registry (`tasks.engines`) agrees with the engines' own folders."""

from __future__ import annotations

import importlib.util

import pytest

from runtimes.pytorch.families import ADAPTERS as PYTORCH_ADAPTERS
from tasks import engines
from tasks.adapters import ADAPTERS
from tasks.catalog import LORA_ADAPTERS


def _exists(path: str) -> bool:
    return importlib.util.find_spec(path.partition(":")[0]) is not None


@pytest.mark.parametrize("name", list(engines.ENGINES))
def test_every_entry_names_modules_that_exist_and_formats_it_serves_on_cpu(name):
    entry = engines.engine(name)
    assert entry.name == name and _exists(entry.start), entry.start
    assert all(_exists(module) for module in entry.imports), entry.imports
    assert entry.families and entry.families <= set(ADAPTERS)
    assert set(entry.cpu_precisions) <= set(entry.precisions)


def test_pytorch_serves_every_family_of_the_contract_from_its_own_map():
    assert set(PYTORCH_ADAPTERS) == set(ADAPTERS) == engines.engine("pytorch").families
    assert all(_exists(path) for path in PYTORCH_ADAPTERS.values())
    assert engines.engine(engines.DEFAULT).loras and engines.DEFAULT == "pytorch"


def test_onnx_serves_the_families_of_its_map():
    from runtimes.onnx.engine import ADAPTERS as ONNX_ADAPTERS
    from runtimes.onnx.engine import OnnxEngine

    assert set(ONNX_ADAPTERS) == engines.engine("onnx").families
    assert OnnxEngine.adapters is ONNX_ADAPTERS and not engines.engine("onnx").loras


def test_the_servers_and_the_double_start_a_runtime_by_name():
    from runtimes.doubles.sim.start import start_runtime as sim_start
    from runtimes.sglang import start_runtime as sglang_start

    assert engines.resolve(engines.engine("sglang").start) is sglang_start
    assert engines.resolve(engines.engine("sim").start) is sim_start
    assert engines.names("process") == ["pytorch", "onnx"]
    assert engines.names(*engines.PER_MODEL) == ["pytorch", "onnx", "sglang"]


class _Entry:
    def __init__(self, adapter: str, pooling: str | None = None, loras: bool = False) -> None:
        self.adapter, self.pooling = adapter, pooling
        self.loras = {"a": object()} if loras else {}


def test_what_each_worker_wide_engine_takes():
    onnx, sglang = engines.engine("onnx"), engines.engine("sglang")
    assert onnx.takes_over(_Entry("dense")) and not onnx.takes_over(_Entry("clip"))
    assert not onnx.takes_over(_Entry("dense", loras=True))
    assert sglang.takes_over(_Entry("causal-lm"))
    assert sglang.takes_over(_Entry("dense", "lasttoken"))
    assert not sglang.takes_over(_Entry("dense", "mean"))
    # SGLang serves no LoRA adapters: a causal LM with some stays where they are served.
    assert not sglang.takes_over(_Entry("causal-lm", loras=True))
    assert {"dense", "causal-lm"} == LORA_ADAPTERS


def test_onboarding_tries_each_process_engine_that_serves_the_entry_baseline_first():
    # The pairs onboarding tried before it asked the registry, in the same order.
    assert engines.candidates(_Entry("dense"), cuda=False) == [
        ("pytorch", "fp32"), ("pytorch", "bf16"), ("onnx", "fp32"), ("onnx", "int8")]
    assert engines.candidates(_Entry("dense"), cuda=True) == [
        ("pytorch", "fp32"), ("pytorch", "bf16"), ("pytorch", "fp16"),
        ("onnx", "fp32"), ("onnx", "fp16")]
    assert engines.candidates(_Entry("clip"), cuda=False) == [("pytorch", "fp32"),
                                                              ("pytorch", "bf16")]
    # Neither SGLang (its own servers) nor the double is a candidate; ONNX serves no LoRAs.
    assert engines.candidates(_Entry("causal-lm"), cuda=True)[0] == engines.BASELINE
    assert {e for e, _ in engines.candidates(_Entry("dense", loras=True), True)} == {"pytorch"}
    for name in engines.names():
        registered = engines.engine(name)
        assert set(registered.trials(True)) <= set(registered.precisions)
        assert set(registered.trials(False)) <= set(registered.cpu_precisions)


def test_an_engine_declares_what_it_needs_before_computing_and_the_double_is_known_by_kind():
    from runtimes.onnx.graphs import HEADS
    from runtimes.onnx.prepare import prepare

    assert engines.resolve(engines.engine("onnx").prepare) is prepare
    # `shoal export` checks a family against the graphs' heads: the same families.
    assert set(HEADS) == engines.engine("onnx").families
    assert not engines.engine("pytorch").prepare
    assert [name for name in engines.names() if engines.is_double(name)] == ["sim"]


def test_engine_names_are_written_only_in_the_registry_and_the_engines_own_folders():
    """Issue 55: everything else asks the registry (`DEFAULT`, `BASELINE`, `candidates`,
    `is_double`, an entry's `prepare`), so a registered engine is served and onboarded."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    spelled = {*engines.names(), "emulated", "faulty"}
    own = [root / "runtimes" / name for name in ("onnx", "pytorch", "sglang", "doubles")]
    found = []
    for folder in ("app", "gateway", "batching", "tasks", "runtimes"):
        for path in sorted((root / folder).rglob("*.py")):
            if path == root / "tasks" / "engines.py" or any(path.is_relative_to(o) for o in own):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in spelled:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert not found, found
