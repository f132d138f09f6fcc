"""One model on ONNX Runtime: its graph's session, its tokenizer and its config.

The graph is found by `runtimes.onnx.graphs`; one that is missing is exported first by
`python -m runtimes.onnx.export` in a child process when torch is installed (it stays
out of this process), else the load fails with the `shoal export` command to run. A
graph that ONNX Runtime cannot read fails the load of that model only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnxruntime as ort

from runtimes.families.text import chunked_inputs, max_length
from runtimes.onnx.graphs import GraphMissing, graph_of
from runtimes.onnx.tokenizer import FileTokenizer

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 600


class SessionClock:
    """Busy time of the device in sessions' runs, taken batch by batch (the host's
    device clock): ONNX Runtime's run returns when its outputs are on the host, so its
    wall time is the device's time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0

    def bill(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def take_span(self) -> Busy:
        with self._lock:
            seconds, self._seconds = self._seconds, 0.0
        return Busy(seconds)


class Busy:
    __slots__ = ("_seconds",)

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def seconds(self) -> float:
        return self._seconds


def read_config(folder: Path) -> SimpleNamespace:
    """What the runtime reads of a model's config.json, as transformers' config has it
    (id2label keyed by int)."""
    path = folder / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    id2label = {int(k): v for k, v in (raw.get("id2label") or {}).items()}
    return SimpleNamespace(
        num_labels=len(id2label) or int(raw.get("num_labels", 2)),
        id2label=id2label,
        label2id=raw.get("label2id") or {},
        problem_type=raw.get("problem_type"),
        max_position_embeddings=raw.get("max_position_embeddings"),
        hidden_size=raw.get("hidden_size"),
        vocab_size=raw.get("vocab_size"),
    )


def providers(device: str) -> list[str]:
    if not device.startswith("cuda"):
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ValueError(f"device {device}: this onnxruntime has no CUDA execution provider "
                         f"(it has {ort.get_available_providers()}); install onnxruntime-gpu")
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def export_command(model_id: str, precision: str) -> str:
    return f"shoal export {model_id} --precision {precision}"


def obtain_graph(model_id: str, folder: Path, family: str, precision: str) -> Path:
    """The graph to serve; exported first (in a child process) if missing and torch is
    installed. GraphMissing, naming the command to run, if it cannot be had."""
    graph = graph_of(folder, family, precision)
    if graph.is_file():
        return graph
    if importlib.util.find_spec("torch") is None:
        raise GraphMissing(
            f"{model_id} has no ONNX graph in {precision} (looked for {folder}/onnx/ and "
            f"{graph}); run `{export_command(model_id, precision)}` where torch is installed, "
            "with the same SHOAL_ONNX_CACHE, or ship onnx/model.onnx in the model folder")
    log.info("exporting %s to ONNX (%s): %s", model_id, precision, graph)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "runtimes.onnx.export", str(folder), "--family", family,
         "--precision", precision], capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S,
        check=False)
    if done.returncode != 0 or not graph.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise GraphMissing(f"{model_id}: exporting its ONNX graph ({precision}) failed: "
                           + " | ".join(tail))
    log.info("exported %s in %.1fs", model_id, time.perf_counter() - started)
    return graph


class OnnxModel:
    """A graph's session with the model folder's tokenizer and config."""

    def __init__(self, model_id: str, folder: Path, family: str, *, precision: str,
                 device: str, threads: int, clock: SessionClock,
                 max_seq_length: tuple[int | None, ...] = ()) -> None:
        self.graph = obtain_graph(model_id, folder, family, precision)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # No spin-waiting after a run: the idle intra-op threads would burn the cores the
        # gateway, RabbitMQ and the worker need between batches.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # warnings about unused initializers are noise here
        try:
            self.session = ort.InferenceSession(str(self.graph), options,
                                                providers=providers(device))
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf types
            raise ValueError(
                f"{model_id}: ONNX Runtime cannot read {self.graph} ({exc}); delete it and run "
                f"`{export_command(model_id, precision)}` again") from exc
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.output_name = self.session.get_outputs()[0].name
        self.tokenizer = FileTokenizer(folder, "token_type_ids" in self.input_names)
        self.config = read_config(folder)
        self.max_length = max_length(self.tokenizer, self.config, *max_seq_length)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.clock = clock
        data = self.graph.with_name(self.graph.name + ".data")  # external weights, if any
        self.graph_bytes = self.graph.stat().st_size + (data.stat().st_size if data.is_file()
                                                        else 0)

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The graph's first output for padded inputs (those the graph takes)."""
        feeds = {k: v for k, v in inputs.items() if k in self.input_names}
        if "token_type_ids" in self.input_names and "token_type_ids" not in feeds:
            feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])  # one segment
        started = time.perf_counter()
        try:
            return self.session.run([self.output_name], feeds)[0]
        finally:
            self.clock.bill(time.perf_counter() - started)

    def chunks(self, input_ids: list[list[int]], token_type_ids: list[list[int]] | None,
               budget: int) -> list[tuple[list[int], dict[str, Any]]]:
        """Padded inputs per chunk of similar lengths (`runtimes.families.text.chunked_inputs`)."""
        if "token_type_ids" not in self.input_names:
            token_type_ids = None
        return list(chunked_inputs(input_ids, token_type_ids, self.pad_id, budget))
