"""What ONNX needs before a host computes an entry with it: the entry's graph at the
precision, exported into the cache when neither shipped nor exported before (the
registry's `prepare` step for this engine, `tasks.engines`; `shoal export` runs the same
export ahead)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from runtimes.onnx.graphs import HEADS

if TYPE_CHECKING:
    from tasks.catalog import ModelEntry


def graph_folder(entry: ModelEntry) -> Path:
    """Where the graph's transformer sits: a SparseEncoder save keeps it in a subfolder."""
    from runtimes.families.splade import read_splade_config
    from runtimes.model_files.files import encoder_ref
    from tasks.sources import resolve_source

    ref = resolve_source(entry.source)
    if entry.adapter == "sparse":
        return Path(encoder_ref(ref, read_splade_config(ref).encoder_dir))
    return Path(ref)


def prepare(entry: ModelEntry, precision: str) -> None:
    """The entry's graph at `precision`, exported now if it is missing (needs torch)."""
    from runtimes.onnx.export import export_graph

    if entry.adapter not in HEADS:
        raise ValueError(f"the ONNX runtime does not serve {entry.adapter!r}")
    export_graph(graph_folder(entry), entry.adapter, precision)
