"""Adding a family touches its contract, its family module and, per engine that serves it,
a primitive and one map line (issue 55), beside the toy engine of test_toy_engine.py.

The toy family below is written as a real one is, its files in a temporary package:

1. its contract: the `AdapterContract` that `tasks.adapters.register` adds, the line a real
   family writes into `tasks.adapters.ADAPTERS`;
2. its family module (`runtimes/families/<family>.py` for a real one): all of its logic,
   the checks, tokenizing, pooling and results, once, over a primitive it declares;
3. per engine, the primitive (`runtimes/<engine>/<family>.py`): here PyTorch's, which
   computes each word's hidden state, and the subclass that binds it;
4. the engine's map line (`runtimes.pytorch.families.ADAPTERS`);
5. the engine's registry line says it serves the family (`tasks.engines`; PyTorch's and
   the simulated device's `families` are every contract of `tasks.adapters` at import,
   so a family written there needs nothing more; one registered later is added here).

Nothing else changes, yet the catalog takes an entry of it and the real PyTorch engine's
model host serves a batch, the family's checks failing the request they refuse alone. A
second engine (the toy engine, with a numpy primitive) serves it too, with the same bytes:
steps 3 to 5 again for that engine, the family module as it is.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from runtimes.base import Request
from runtimes.child_side.host import ModelHost
from runtimes.pytorch import families
from tasks import adapters, engines
from tasks.adapters import DENSE, ENCODE, TEXT, AdapterContract
from tasks.catalog import ModelEntry
from tasks.engines import EngineEntry
from tasks.results import embedding_rows
from tests.unit.runtimes.test_toy_engine import ENGINE_PY as TOY_ENGINE_PY

ROOT = Path(__file__).resolve().parents[3]

# 1. Its contract.
TOY = AdapterContract("toy-words", ENCODE, frozenset({TEXT}), (DENSE,), True,
                      "test-only: the mean of each word's vector")

# 2. Its family module: the logic, written once for every engine.
FAMILY_PY = '''
from abc import abstractmethod
from typing import Any, Protocol

import numpy as np

from runtimes.child_side.adapter import Adapter
from runtimes.families.text import check_lengths
from runtimes.families.vectors import dense_results
from tasks.schema import ParsedRequest, invalid

MAX_WORDS = 4


class WordStates(Protocol):
    """What an engine supplies: one hidden state per word."""

    def states(self, words: list[str]) -> np.ndarray: ...


class WordsAdapter(Adapter):
    """A text's vector: the mean of its lowercased words' states."""

    def __init__(self, entry: Any, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.model = self.word_states()

    @abstractmethod
    def word_states(self) -> WordStates: ...

    def check(self, parsed: ParsedRequest) -> ParsedRequest:
        words = [text.split() for text in parsed.texts]
        for i, row in enumerate(words):
            if not row:
                raise invalid(f"items[{i}] has no word")
        if not parsed.options.truncate:
            check_lengths([len(row) for row in words], MAX_WORDS)
        return parsed

    def run(self, prepared: list[ParsedRequest]) -> list[dict[str, Any]]:
        texts = [t.lower().split()[:MAX_WORDS] for p in prepared for t in p.texts]
        states = self.model.states([w for words in texts for w in words])
        vectors, at = np.zeros((len(texts), self.entry.dims), np.float32), 0
        for i, words in enumerate(texts):
            vectors[i] = states[at:at + len(words)].mean(axis=0)
            at += len(words)
        ids = [[0] * len(words) for words in texts]  # usage: one token a word
        return dense_results(prepared, vectors, ids, normalize_default=False)
'''

# 3. PyTorch's primitive and the subclass that binds it.
TORCH_PY = '''
import numpy as np
import torch

from toy_family.family import WordsAdapter


class TorchWordStates:
    """A word's state: its length, its vowels, 1 and zeros, computed by torch."""

    def __init__(self, device: str, dims: int) -> None:
        self.device, self.dims = device, dims

    def states(self, words: list[str]) -> np.ndarray:
        out = torch.zeros((len(words), self.dims), device=self.device)
        out[:, 0] = torch.tensor([float(len(w)) for w in words])
        out[:, 1] = torch.tensor([float(sum(c in "aeiou" for c in w)) for w in words])
        out[:, 2] = 1.0
        return out.cpu().numpy()


class TorchWordsAdapter(WordsAdapter):
    def word_states(self) -> TorchWordStates:
        return TorchWordStates(self.device, self.entry.dims)
'''

# A second engine's primitive: the toy engine of test_toy_engine.py, its map naming this
# family (its step 4), serving it with numpy: the family module is not copied.
NUMPY_PY = '''
import numpy as np

from toy_family.family import WordsAdapter


class NumpyWordStates:
    def __init__(self, dims: int) -> None:
        self.dims = dims

    def states(self, words: list[str]) -> np.ndarray:
        out = np.zeros((len(words), self.dims), dtype=np.float32)
        out[:, 0] = [len(w) for w in words]
        out[:, 1] = [sum(c in "aeiou" for c in w) for w in words]
        out[:, 2] = 1.0
        return out


class NumpyWordsAdapter(WordsAdapter):
    def word_states(self) -> NumpyWordStates:
        return NumpyWordStates(self.entry.dims)
'''
TOY_MAP = 'ADAPTERS = {"dense": "toy_engine.dense:ToyDenseAdapter"}'
assert TOY_MAP in TOY_ENGINE_PY
NUMPY_ENGINE_PY = TOY_ENGINE_PY.replace(
    TOY_MAP, f'ADAPTERS = {{"{TOY.name}": "toy_family.numpy_words:NumpyWordsAdapter"}}')
NUMPY_ENGINE = EngineEntry("toy", "process", "toy_family.engine:ToyEngine",
                           frozenset({TOY.name}), ("fp32",), ("fp32",))


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AdapterContract]:
    package = tmp_path / "toy_family"
    package.mkdir()
    (package / "__init__.py").write_text('"""A toy family: its module and a primitive."""\n')
    (package / "family.py").write_text(textwrap.dedent(FAMILY_PY))
    (package / "torch_words.py").write_text(textwrap.dedent(TORCH_PY))
    (package / "numpy_words.py").write_text(textwrap.dedent(NUMPY_PY))
    (package / "engine.py").write_text(textwrap.dedent(NUMPY_ENGINE_PY))
    monkeypatch.syspath_prepend(str(tmp_path))
    adapters.register(TOY)
    try:
        # 4. The engine's map line.
        monkeypatch.setitem(families.ADAPTERS, TOY.name, "toy_family.torch_words:TorchWordsAdapter")
        # 5. The engine's registry line serves it.
        pytorch = engines.engine("pytorch")
        monkeypatch.setitem(engines.ENGINES, "pytorch", dataclasses.replace(
            pytorch, families=pytorch.families | {TOY.name}))
        yield TOY
    finally:
        adapters.unregister(TOY.name)


def _entry(tmp_path: Path, **fields: object) -> ModelEntry:
    return ModelEntry.model_validate({"id": "toy/words", "adapter": TOY.name, "dims": 4,
                                      "source": {"path": str(tmp_path)}, **fields})


def test_the_pytorch_host_serves_a_family_added_in_five_places(toy, tmp_path):
    entry = _entry(tmp_path)
    assert entry.runtime == "pytorch" and entry.tasks == [ENCODE]
    host = ModelHost(engine="pytorch")
    host.load_one(entry)
    outcomes = host.run_batch(entry.id, [
        Request("a", "encode", {"items": [{"text": "Hello toy world"}, {"text": "sea"}]}),
        Request("b", "encode", {"items": [{"text": "fine"}, {"text": "   "}]}),
        Request("c", "encode", {"items": [{"text": "one two three four five"}],
                                "options": {"truncate": False}}),
        Request("d", "encode", {"items": [{"text": "one two three four five"}],
                                "options": {"dimensions": 2}}),
        Request("e", "score", {"items": [{"text": "x"}], "query": "q"}),
    ])
    a, b, c, d, e = outcomes
    assert a.ok and a.result is not None and a.result["model"] == "toy/words"
    # hello (5, 2), toy (3, 1), world (5, 1): their mean; sea (3, 2).
    np.testing.assert_allclose(embedding_rows(a.result),
                               [[13 / 3, 4 / 3, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]], rtol=1e-6)
    assert a.result["usage"] == {"tokens": 4}
    # The family's checks fail the requests they refuse, and only them.
    assert (b.ok, b.error_code) == (False, "VALIDATION_ERROR")
    assert "items[1] has no word" in (b.error_message or "")
    assert (c.ok, c.error_code) == (False, "INPUT_TOO_LONG")
    assert d.ok and d.result is not None and embedding_rows(d.result) == [[3.75, 1.75]]
    assert (e.ok, e.error_code) == (False, "UNSUPPORTED_OPERATION")


def test_a_second_engine_serves_it_with_its_primitive_only(toy, tmp_path):
    engines.register(NUMPY_ENGINE)
    try:
        request = [Request("a", "encode", {"items": [{"text": "Hello toy world"},
                                                     {"text": "sea"}]})]
        results = []
        for engine, entry in (("pytorch", _entry(tmp_path)),
                              ("toy", _entry(tmp_path, runtime="toy"))):
            host = ModelHost(engine=engine)
            host.load_one(entry)
            (outcome,) = host.run_batch(entry.id, request)
            assert outcome.ok and outcome.result is not None
            results.append(outcome.result)
        torch_result, numpy_result = results
        assert numpy_result["embeddings"] == torch_result["embeddings"]
        assert numpy_result["usage"] == torch_result["usage"] == {"tokens": 4}
    finally:
        engines.unregister(NUMPY_ENGINE.name)


def test_the_catalog_knows_it_only_while_registered(toy, tmp_path):
    with pytest.raises(ValidationError, match=r"toy-words.*needs the width of its vectors"):
        ModelEntry.model_validate({"id": "toy/words", "adapter": TOY.name,
                                   "source": {"path": str(tmp_path)}})
    with pytest.raises(ValidationError, match=r"cannot run on onnx.*\['cross-encoder'"):
        _entry(tmp_path, runtime="onnx")  # onnx's registry line does not name it
    with pytest.raises(ValueError, match="registered already"):
        adapters.register(TOY)
    adapters.unregister(TOY.name)
    with pytest.raises(ValidationError, match="unknown adapter 'toy-words'"):
        _entry(tmp_path)


def test_a_family_of_an_unknown_operation_is_refused():
    with pytest.raises(ValueError, match="unknown operation 'embed'"):
        adapters.register(dataclasses.replace(TOY, operation="embed"))
    assert TOY.name not in adapters.ADAPTERS


# The real families that follow the recipe: each engine's module holds its primitive and a
# subclass that binds it, none of the family's logic.
ENGINE_FILES = {
    "runtimes/families/dense.py": ["runtimes/pytorch/dense.py", "runtimes/onnx/dense.py"],
    "runtimes/families/sparse.py": ["runtimes/pytorch/sparse.py", "runtimes/onnx/sparse.py"],
    "runtimes/families/multivector.py": ["runtimes/pytorch/multivector.py"],
    "runtimes/families/clip.py": ["runtimes/pytorch/clip.py"],
    "runtimes/families/causal_lm.py": ["runtimes/pytorch/causal_lm.py"],
    "runtimes/families/classifiers.py": ["runtimes/pytorch/sequence_classification.py",
                                         "runtimes/pytorch/cross_encoder.py",
                                         "runtimes/onnx/classify.py"],
    "runtimes/families/entities.py": ["runtimes/pytorch/token_classification.py",
                                      "runtimes/onnx/tokens.py"],
}
FAMILY_LOGIC = {"check", "prepare", "run", "plan", "finish", "scored", "probe"}


def _classes(path: str) -> list[ast.ClassDef]:
    tree = ast.parse((ROOT / path).read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


@pytest.mark.parametrize("family", sorted(ENGINE_FILES))
def test_the_engines_of_a_real_family_supply_primitives_only(family):
    ours = {node.name for node in _classes(family)}
    for path in ENGINE_FILES[family]:
        classes = _classes(path)
        methods = {item.name for node in classes for item in node.body
                   if isinstance(item, ast.FunctionDef)}
        assert not methods & FAMILY_LOGIC, f"{path} writes the family's {methods & FAMILY_LOGIC}"
        bases = {ast.unparse(base).rpartition(".")[2] for node in classes for base in node.bases}
        assert bases & ours, f"{path} builds on none of {family}'s classes"
