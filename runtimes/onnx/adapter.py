"""What every ONNX Runtime adapter shares: its model's session, built with the engine's
threads and clock (`runtimes.onnx.engine` binds them to the adapter class it hands out)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from runtimes.child_side.adapter import Adapter
from runtimes.onnx.session import OnnxModel, SessionClock


class OnnxAdapter(Adapter):
    family: ClassVar[str]  # the catalog adapter it serves (its graph's head)
    threads: ClassVar[int] = 0  # ONNX Runtime's intra-op threads; 0: its own choice
    clock: ClassVar[SessionClock] = SessionClock()

    model: OnnxModel  # the session (a classifier's is its classifier's)

    @property
    def graph_bytes(self) -> int:
        """What its graph's weights take (ONNX Runtime adds an arena per session)."""
        return self.model.graph_bytes

    def open_model(self, folder: str | Path, *max_seq_length: int | None) -> OnnxModel:
        """The session of the entry's graph for `folder` (the model, or the transformer's
        folder inside a sentence-transformers save); its length limit the first of
        `max_seq_length` given, else the tokenizer's."""
        return OnnxModel(self.entry.id, Path(folder), self.family, precision=self.precision,
                         device=self.device, threads=self.threads, clock=self.clock,
                         max_seq_length=max_seq_length)
