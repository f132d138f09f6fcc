"""Adding an engine touches its own folder and one registry line (issues 39 and 55).

The toy engine below is a package of its own, written into a temporary folder: an engine
class (`runtimes.child_side.host.Engine`) with its family map, one adapter, and the step
it needs before computing a model (optional; ONNX's exports the graph). Its registry
line is the `EngineEntry` that `register` adds, the line a real engine writes into
`tasks.engines.ENGINES`:

    EngineEntry("toy", "process", "toy_engine.engine:ToyEngine", frozenset({"dense"}),
                ("fp32",), ("fp32",), prepare="toy_engine.prepare:prepare"),

Nothing else changes, yet settings, the catalog, the worker's choice of engine, the
runtime process's command line and the model host all take it, and the host serves a
batch with it; onboarding and `shoal tune` try it, and its parity computes through it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from app.onboard import probes
from app.onboard.engine_choice import engine_candidates
from app.onboard.parity import Reference, settings_key
from app.onboard.tuning import device_candidates, parity_at_each
from app.worker.runtime import runtime_of_models
from runtimes.base import Request
from runtimes.child_side import server
from runtimes.child_side.host import ModelHost, make_engine
from tasks import engines
from tasks.catalog import ModelEntry
from tasks.engines import EngineEntry
from tasks.results import embedding_rows
from tasks.settings import Settings

TOY = EngineEntry("toy", "process", "toy_engine.engine:ToyEngine", frozenset({"dense"}),
                  ("fp32",), ("fp32",), prepare="toy_engine.prepare:prepare")

# The toy engine's folder: what `runtimes/<engine>/` holds for a real one.
ENGINE_PY = '''
from typing import Any

from runtimes.child_side.adapter import Adapter
from tasks.catalog import ModelEntry
from tasks.engines import resolve

ADAPTERS = {"dense": "toy_engine.dense:ToyDenseAdapter"}


class Span:
    def seconds(self) -> float:
        return 0.0


class Clock:
    def take_span(self) -> Span:
        return Span()


class ToyEngine:
    name = "toy"
    adapters = ADAPTERS

    def __init__(self, device: str, threads: int = 0) -> None:
        self.device = device
        self.clock = Clock()

    def adapter_class(self, entry: ModelEntry) -> type[Adapter]:
        return resolve(self.adapters[entry.adapter])

    def precision(self, entry: ModelEntry, override: str | None) -> str:
        return override or "fp32"

    def allocated(self) -> int:
        return 0

    def measure(self, adapter: Adapter, allocated_before: int) -> int:
        return 1024

    def release(self) -> None:
        pass

    def offload(self, adapter: Adapter, budget: int) -> int | None:
        return 1024 if budget >= 1024 else None  # nothing on a device: kept as it is

    def restore(self, adapter: Adapter) -> None:
        pass

    def total_bytes(self) -> int:
        return 2**30

    def stamp(self) -> dict[str, Any] | None:
        return None

    def warm(self) -> None:
        pass
'''

DENSE_PY = '''
from typing import Any

import numpy as np

from runtimes.child_side.adapter import Adapter
from runtimes.families.vectors import dense_result


class ToyDenseAdapter(Adapter):
    """Each text's vector: its length in characters, in words, and 1, 0 after."""

    def run(self, prepared: list[Any]) -> list[dict[str, Any]]:
        results = []
        for parsed in prepared:
            rows = np.zeros((len(parsed.texts), self.entry.dims), dtype=np.float32)
            for i, text in enumerate(parsed.texts):
                rows[i, :3] = [len(text), len(text.split()), 1.0]
            results.append(dense_result(rows, parsed.options, False,
                                        sum(len(t.split()) for t in parsed.texts)))
        return results
'''


# What it needs before a host computes an entry (ONNX's exports the graph): a mark here.
PREPARE_PY = '''
from pathlib import Path

from tasks.catalog import ModelEntry


def prepare(entry: ModelEntry, precision: str) -> None:
    (Path(entry.source.path) / f"prepared-{precision}").touch()
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineEntry]:
    package = tmp_path / "toy_engine"
    package.mkdir()
    (package / "__init__.py").write_text('"""A toy engine: its own folder."""\n')
    (package / "engine.py").write_text(textwrap.dedent(ENGINE_PY))
    (package / "dense.py").write_text(textwrap.dedent(DENSE_PY))
    (package / "prepare.py").write_text(textwrap.dedent(PREPARE_PY))
    monkeypatch.syspath_prepend(str(tmp_path))
    engines.register(TOY)
    try:
        yield TOY
    finally:
        engines.unregister(TOY.name)


def _entry(tmp_path: Path, **fields: object) -> ModelEntry:
    return ModelEntry.model_validate({"id": "toy/dense", "adapter": "dense", "dims": 4,
                                      "source": {"path": str(tmp_path)}, **fields})


def test_the_host_serves_a_batch_on_an_engine_added_by_one_registry_line(toy, tmp_path):
    entry = _entry(tmp_path, runtime="toy")
    host = ModelHost(engine="toy")
    assert host.load_one(entry) == 1024
    outcomes = host.run_batch(entry.id, [
        Request("a", "encode", {"items": [{"text": "hello toy world"}, {"text": "hi"}]}),
        Request("b", "score", {"items": [{"text": "x"}], "query": "q"}),  # not its operation
    ])
    assert outcomes[0].ok and outcomes[1].error_code == "UNSUPPORTED_OPERATION"
    result = outcomes[0].result
    assert result is not None and result["model"] == "toy/dense"
    assert embedding_rows(result) == [[15.0, 3.0, 1.0, 0.0], [2.0, 1.0, 1.0, 0.0]]
    assert result["usage"] == {"tokens": 4}


def test_settings_the_catalog_the_worker_and_the_child_read_it(toy, tmp_path):
    assert Settings(runtime="toy").runtime == "toy"
    assert _entry(tmp_path, runtime="toy").runtime == "toy"
    # The worker's SHOAL_RUNTIME moves what it takes onto it (its families, no LoRAs).
    plain = _entry(tmp_path)
    lm = ModelEntry.model_validate({"id": "toy/lm", "adapter": "causal-lm",
                                    "source": {"hub": "x/y"}})
    assert runtime_of_models([plain, lm], "toy") == {"toy/dense": "toy", "toy/lm": "pytorch"}
    # The runtime process takes `--engine toy` and imports what its entry names.
    args = server._parse(["--socket", "s", "--catalog-dir", "c", "--engine", "toy"])
    assert args.engine == "toy"
    assert server.engine_imports("toy") == ["runtimes.child_side.host"]
    assert make_engine("toy", "cpu").name == "toy"


def test_what_it_does_not_serve_is_refused_naming_what_it_does(toy, tmp_path):
    with pytest.raises(ValidationError, match=r"cannot run on toy.*\['dense'\]"):
        ModelEntry.model_validate({"id": "toy/lm", "adapter": "causal-lm", "runtime": "toy",
                                   "source": {"hub": "x/y"}})
    with pytest.raises(ValidationError, match="bf16 is not a format of runtime toy"):
        _entry(tmp_path, runtime="toy", profiles={"cpu": {"precision": "bf16"}})
    with pytest.raises(ValidationError, match="the toy runtime serves no LoRA adapters"):
        _entry(tmp_path, runtime="toy", loras={"a": {"path": "/a"}})


def test_an_engine_not_registered_is_refused_with_the_names_there_are(tmp_path):
    with pytest.raises(ValidationError, match=r"unknown runtime 'toy'; allowed: \[.*'onnx'"):
        Settings(runtime="toy")
    with pytest.raises(ValidationError, match=r"unknown runtime 'toy'; allowed: \[.*'sglang'"):
        _entry(tmp_path, runtime="toy")
    with pytest.raises(ValueError, match="unknown runtime 'toy'"):
        make_engine("toy", "cpu")
    with pytest.raises(SystemExit):
        server._parse(["--socket", "s", "--catalog-dir", "c", "--engine", "toy"])


def test_a_double_or_a_server_engine_is_no_entry_runtime_nor_a_host_engine(tmp_path):
    with pytest.raises(ValidationError, match=r"unknown runtime 'sim'; allowed: \['pytorch', "
                                              r"'onnx', 'sglang'\]"):
        _entry(tmp_path, runtime="sim")
    with pytest.raises(ValueError, match=r"does not compute in shoal's runtime process; those "
                                         r"that do: \['pytorch', 'onnx'\]"):
        make_engine("sglang", "cpu")
    with pytest.raises(ValueError, match="registered already"):
        engines.register(engines.engine("onnx"))


def _toy_vectors(texts: tuple[str, ...]) -> np.ndarray:
    return np.array([[len(t), len(t.split()), 1.0, 0.0] for t in texts], dtype=np.float32)


def test_onboarding_tries_it_and_its_parity_computes_through_it(toy, tmp_path):
    entry = _entry(tmp_path)  # names no engine, as onboarding's detected entry
    # The registry's candidates, after those of the engines before it; none on a family
    # it does not serve.
    assert engines.candidates(entry, cuda=False)[0] == engines.BASELINE
    assert engines.candidates(entry, cuda=False)[-1] == ("toy", "fp32")
    assert engines.candidates(entry, cuda=True)[-1] == ("toy", "fp32")
    assert device_candidates(entry)[-1] == ("toy", "fp32")
    assert device_candidates(entry, ["toy:fp32"]) == [("toy", "fp32")]
    assert engine_candidates(entry, "cpu")[-1] == ("toy", "fp32")  # `shoal tune`'s choice
    clip = ModelEntry.model_validate({"id": "toy/clip", "adapter": "clip", "dims": 4,
                                      "source": {"path": str(tmp_path)}})
    assert all(name != "toy" for name, _ in engines.candidates(clip, cuda=False))
    # Onboarding's parity of a candidate: its prepare step, then the probes on a host of
    # it, held to the reference (here the toy's own vectors, then other ones).
    fields = entry.model_dump(exclude_none=True)
    right = Reference("dense", "by hand", {"document": _toy_vectors(probes.TEXTS)},
                      settings_key(entry))
    parity = parity_at_each(fields, tmp_path, None, right)("toy", "fp32")
    assert parity.ok and parity.figures["cosine_min"] > 0.9999, parity.detail
    assert (tmp_path / "prepared-fp32").is_file()
    wrong = Reference("dense", "by hand",
                      {"document": _toy_vectors(probes.TEXTS)[:, ::-1].copy()},
                      settings_key(entry))
    assert not parity_at_each(fields, tmp_path, None, wrong)("toy", "fp32").ok
