"""The engines that compute shoal's models: one entry each, the only place their names live.

Settings (`SHOAL_RUNTIME`), the catalog (an entry's `runtime`, the families and formats it
allows), the worker (which runtime it starts, which model goes where) and the runtime
process (which engine its host builds, what a spare imports ahead) read this registry;
none of them names an engine. An engine is its folder (`runtimes/<engine>/`, or wherever
`start` points) plus its line in `ENGINES`:

- `process`: it computes in shoal's runtime process. `start` names a class that meets
  `runtimes.child_side.host.Engine` (built as `Class(device, threads)`; its `adapters` map
  each family to its adapter class, "module:Class"); the worker runs it through
  `runtimes.worker_side.process.ProcessRuntime` (`--engine NAME`).
- `servers`: it serves from servers of its own (SGLang). `start` names a function that
  meets `runtimes.base.StartRuntime` and returns the `Runtime` the worker talks to.
- `double`: it stands in for every engine of a worker (the simulated device); `start` as
  for `servers`. A catalog entry cannot name it, only SHOAL_RUNTIME.

Onboarding and `shoal tune` ask it which engines to try for an entry (`computing`) and
in which formats on a device (`candidates`: the baseline first, then each engine's
`trials`), and what an engine needs before it computes a model (`prepare`: ONNX's graph).

Nothing here imports an engine: `start` and the family maps are strings, imported where
the engine runs (`resolve`). A test or a plugin adds an engine with `register`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tasks.adapters import ADAPTERS
from tasks.precision import CPU_PRECISIONS, PRECISIONS, Precision

Kind = Literal["process", "servers", "double"]

# The engine of an entry that names none, and of a worker that sets no SHOAL_RUNTIME.
DEFAULT = "pytorch"
# What onboarding verifies an entry with and holds every other candidate to.
BASELINE: tuple[str, Precision] = (DEFAULT, "fp32")


class EntryFacts(Protocol):
    """What an engine's `takes` reads of a catalog entry (`tasks.catalog.ModelEntry`)."""

    @property
    def adapter(self) -> str: ...

    @property
    def pooling(self) -> str | None: ...

    @property
    def loras(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class EngineEntry:
    name: str  # what SHOAL_RUNTIME and a catalog entry's `runtime` say
    kind: Kind
    start: str  # "module:Name", imported only where the engine runs (see the module doc)
    families: frozenset[str]  # the adapters (model families) it serves
    precisions: tuple[Precision, ...]  # the number formats it computes in
    cpu_precisions: tuple[Precision, ...]  # those it serves on a CPU
    # Heavy modules loading a model imports (a spare or an idle runtime process imports
    # them ahead, with the modules of its families' adapters).
    imports: tuple[str, ...] = ()
    loras: bool = False  # whether it serves LoRA adapters per request
    # With SHOAL_RUNTIME=<name>: whether an entry that names no engine moves onto this one
    # (None: every entry of its families, those with LoRAs only if it serves them).
    takes: Callable[[EntryFacts], bool] | None = None
    summary: str = ""
    # The formats onboarding tries it in on CUDA, in order, where not all it computes in
    # are worth a trial there (empty: `precisions`); on a CPU, `cpu_precisions`.
    cuda_trials: tuple[Precision, ...] = ()
    # "module:function" run before a host computes an entry with it, as
    # `prepare(entry, precision)` (imported there, like `start`): ONNX exports the graph.
    prepare: str = ""

    @property
    def module(self) -> str:
        """The module that implements it."""
        return self.start.partition(":")[0]

    def takes_over(self, entry: EntryFacts) -> bool:
        if self.takes is not None:
            return self.takes(entry)
        return self.serves(entry)

    def serves(self, entry: EntryFacts) -> bool:
        """Whether it can serve the entry at all: its family, and its LoRAs if it has any
        (what a profile's `runtime` is held to; `takes` may be narrower)."""
        return entry.adapter in self.families and (self.loras or not entry.loras)

    def trials(self, cuda: bool) -> tuple[Precision, ...]:
        """The formats onboarding tries it in on a CUDA device or a CPU, in order."""
        if not cuda:
            return self.cpu_precisions
        return self.cuda_trials or self.precisions


def _sglang_takes(entry: EntryFacts) -> bool:
    # What SGLang is built for: causal LMs and last-token-pooled (decoder) embedders; an
    # encoder such as MiniLM stays where it was unless its entry says runtime: sglang.
    return not entry.loras and (entry.adapter == "causal-lm" or
                                (entry.adapter == "dense" and entry.pooling == "lasttoken"))


ENGINES: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("pytorch", "process", "runtimes.pytorch.engine:TorchEngine",
                frozenset(ADAPTERS), PRECISIONS, CPU_PRECISIONS,
                imports=("runtimes.pytorch.loading",), loras=True,
                summary="shoal's runtime process on PyTorch (transformers): every family",
                cuda_trials=("fp32", "bf16", "fp16")),
    EngineEntry("onnx", "process", "runtimes.onnx.engine:OnnxEngine",
                frozenset({"dense", "sparse", "cross-encoder", "token-classification",
                           "sequence-classification", "zero-shot"}),
                # int8: a dynamically quantized graph (`shoal export --precision int8`);
                # fp16 is for CUDA, where its CPU kernels are few.
                ("fp32", "fp16", "int8"), ("fp32", "int8"),
                imports=("runtimes.onnx.session",),
                summary="ONNX Runtime in shoal's runtime process: the text encoders, from "
                        "a graph `shoal export` makes; no torch",
                cuda_trials=("fp32", "fp16"), prepare="runtimes.onnx.prepare:prepare"),
    EngineEntry("sglang", "servers", "runtimes.sglang:start_runtime",
                frozenset({"causal-lm", "dense"}), PRECISIONS, CPU_PRECISIONS,
                takes=_sglang_takes,
                summary="SGLang servers, batching continuously (`make sglang`)"),
    EngineEntry("sim", "double", "runtimes.doubles.sim.start:start_runtime",
                frozenset(ADAPTERS), PRECISIONS, CPU_PRECISIONS, loras=True,
                summary="no model runs: batches sleep as long as SHOAL_DEVICE would take "
                        "and results are fake, marked 'simulated'"),
)}


def engine(name: str) -> EngineEntry:
    """The engine of that name; ValueError naming the engines there are."""
    found = ENGINES.get(name)
    if found is None:
        raise ValueError(f"unknown runtime {name!r}; allowed: {names()}")
    return found


def is_double(name: str) -> bool:
    """Whether the engine of that name stands in for a worker's engines (the simulated
    device)."""
    return engine(name).kind == "double"


def computing(entry: EntryFacts) -> list[EngineEntry]:
    """The engines onboarding and `shoal tune` try for `entry`: each that computes in
    shoal's runtime process and serves it, `DEFAULT` first, then in the registry's order."""
    ordered = sorted(ENGINES.values(), key=lambda registered: registered.name != DEFAULT)
    return [e for e in ordered if e.kind == "process" and e.serves(entry)]


def candidates(entry: EntryFacts, cuda: bool) -> list[tuple[str, Precision]]:
    """(engine, precision) pairs onboarding tries for `entry` on a CUDA device or a CPU,
    in order: `BASELINE` first, then each engine of `computing` in its `trials`."""
    return [(e.name, precision) for e in computing(entry) for precision in e.trials(cuda)]


def names(*kinds: Kind) -> list[str]:
    """The engines of these kinds (all of them if none is given), in the registry's order."""
    return [name for name, e in ENGINES.items() if not kinds or e.kind in kinds]


# The kinds of engine a catalog entry's `runtime` may name (a double serves whole workers).
PER_MODEL: tuple[Kind, ...] = ("process", "servers")


def known(name: str, *kinds: Kind) -> str:
    """`name` if an engine of these kinds (any kind if none is given) has it; else a
    ValueError naming those there are (what settings and the catalog say of a wrong one)."""
    allowed = names(*kinds)
    if name not in allowed:
        raise ValueError(f"unknown runtime {name!r}; allowed: {allowed}")
    return name


def register(entry: EngineEntry) -> None:
    """Add an engine at run time (a test's, a plugin's): settings, the catalog, the worker
    and the runtime process read it from then on, in this process. A name taken is an
    error."""
    if entry.name in ENGINES:
        raise ValueError(f"an engine named {entry.name!r} is registered already")
    ENGINES[entry.name] = entry


def unregister(name: str) -> None:
    ENGINES.pop(name, None)


def resolve(path: str) -> Any:
    """The object a "module:Name" string names (the module imported now)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
