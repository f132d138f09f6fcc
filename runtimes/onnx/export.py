"""Export a model folder's weights to an ONNX graph: `shoal export` and the runtime's
export of a missing graph (`python -m runtimes.onnx.export FOLDER --family F`).

Needs torch and transformers (the serving side needs neither). The graph takes
input_ids, attention_mask (and token_type_ids where the model has them) with dynamic
batch and sequence axes, and gives the model's raw first output (the last hidden
state, or the logits): pooling and scoring stay in the adapters, so a graph shipped in
a model's `onnx/` folder serves the same way. int8 is ONNX Runtime's dynamic
quantization of the fp32 graph (int8 weights, activations quantized per batch), fp16
its float16 conversion with float32 inputs and outputs, for CUDA. ONNX Runtime's graph
fusions apply when a session opens the graph (ORT_ENABLE_ALL): an offline
`onnxruntime.transformers.optimizer` pass made MiniLM no faster here (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

from runtimes.onnx.graphs import HEADS, cached_graph, shipped_graph

log = logging.getLogger(__name__)

OPSET = 17


def _model_class(head: str) -> type:
    import transformers

    return {
        "base": transformers.AutoModel,
        "masked-lm": transformers.AutoModelForMaskedLM,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "token-classification": transformers.AutoModelForTokenClassification,
    }[head]


def _export_fp32(folder: Path, head: str, out: Path) -> None:
    import torch

    model = _model_class(head).from_pretrained(str(folder), local_files_only=True,
                                               attn_implementation="eager")
    model.eval()
    names = ["input_ids", "attention_mask"]
    if getattr(model.config, "type_vocab_size", 0) and "token_type_ids" in \
            inspect.signature(model.forward).parameters:
        names.append("token_type_ids")

    class Graph(torch.nn.Module):
        """The model called by keyword (transformers' positional order varies)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return self.model(**dict(zip(names, inputs, strict=True)))[0]

    # A padded row in the sample: a mask of ones could be traced as "no mask needed".
    sample = [torch.ones((2, 8), dtype=torch.long) for _ in names]
    sample[1] = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    if len(names) > 2:
        sample[2] = torch.zeros((2, 8), dtype=torch.long)
    axes = {name: {0: "batch", 1: "sequence"} for name in names}
    axes["output"] = {0: "batch", 1: "sequence"}
    # The TorchScript exporter (dynamo=False): one self-contained file, and every family
    # here exports through it; its deprecation and tracer warnings are about paths (data-
    # dependent control flow) these encoders do not take, and parity tests check the graph.
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Graph().eval(), tuple(sample), str(out), input_names=names,
                          output_names=["output"], dynamic_axes=axes, opset_version=OPSET,
                          dynamo=False)


def _quantize_int8(source: Path, out: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # Per output channel, matrix products only (the embedding tables stay float): on
    # MiniLM per-tensor scales gave a mean cosine of 0.963 to fp32, these 0.993.
    # reduce_range (7-bit weights): on x86 without VNNI (AVX2 only) ORT's u8s8 products
    # saturate in 16 bits, and a tiny model's int8 answers fell to a cosine of 0.975.
    quantize_dynamic(str(source), str(out), weight_type=QuantType.QInt8, per_channel=True,
                     reduce_range=True, op_types_to_quantize=["MatMul"],
                     extra_options={"DefaultTensorType": 1})  # float, where shapes are unknown


def _convert_fp16(source: Path, out: Path) -> None:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    graph = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
    onnx.save(graph, str(out))


def export_graph(folder: Path, family: str, precision: str = "fp32") -> Path:
    """The graph of `folder` for `family` at `precision` (exported into the cache unless
    shipped or exported before): its path."""
    if family not in HEADS:
        raise ValueError(f"family {family!r}: ONNX graphs are made for {sorted(HEADS)}")
    shipped = shipped_graph(folder, precision)
    if shipped is not None:
        return shipped
    head = HEADS[family]
    out = cached_graph(folder, head, precision)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside, then renamed: a worker never opens half a graph.
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        work = Path(scratch)
        fp32 = shipped_graph(folder, "fp32") or cached_graph(folder, head, "fp32")
        if not fp32.is_file():
            _export_fp32(folder, head, work / "fp32.onnx")
            if precision == "fp32":
                os.replace(work / "fp32.onnx", out)
                return out
            fp32 = work / "fp32.onnx"
        if precision == "int8":
            _quantize_int8(fp32, work / "int8.onnx")
        elif precision == "fp16":
            _convert_fp16(fp32, work / "fp16.onnx")
        os.replace(work / f"{precision}.onnx", out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtimes.onnx.export",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the model's transformer folder")
    parser.add_argument("--family", required=True, choices=sorted(HEADS))
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int8"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    out = export_graph(args.folder, args.family, args.precision)
    log.info("%s (%.1f MiB) in %.1fs", out, out.stat().st_size / 2**20,
             time.perf_counter() - started)


if __name__ == "__main__":
    main()
