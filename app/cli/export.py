"""`shoal export MODEL [--precision fp32|fp16|int8]`: a catalog entry's weights as the ONNX
graph its ONNX runtime serves (`runtimes.onnx.export`; docs/runtimes.md, "ONNX")."""

from __future__ import annotations

import argparse
import sys
import time

from app.cli.models import catalog_dir
from tasks.catalog import load_catalog


def export(args: argparse.Namespace) -> int:
    from runtimes.onnx.export import export_graph
    from runtimes.onnx.graphs import HEADS
    from runtimes.onnx.prepare import graph_folder

    entry = load_catalog(catalog_dir(args)).get(args.model)
    if entry is None:
        print(f"{args.model!r} is not in the catalog (shoal models list)", file=sys.stderr)
        return 1
    if entry.adapter not in HEADS:  # the families ONNX serves (tests/unit/tasks/test_engines.py)
        print(f"{entry.id} is a {entry.adapter} model; the ONNX runtime serves "
              f"{sorted(HEADS)}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    out = export_graph(graph_folder(entry), entry.adapter, args.precision)
    print(f"{entry.id} ({args.precision}): {out} ({out.stat().st_size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - started:.1f}s)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("export", help="export a model to the ONNX graph its ONNX runtime "
                            "serves (needs torch)")
    parser.add_argument("model", help="a catalog id")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int8"],
                        help="int8: dynamically quantized (CPU); fp16: for CUDA")
    parser.add_argument("--catalog-dir", help="a folder of your own entries, read over the "
                        "packaged catalog (default: SHOAL_CATALOG_DIR)")
    parser.set_defaults(run=export)
