"""`shoal export MODEL [--precision fp32|fp16|int8]`: a catalog entry's weights as the ONNX
graph its ONNX runtime serves (`runtimes.onnx.export`; docs/runtimes.md, "ONNX")."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from app.cli.models import catalog_dir
from tasks.catalog import load_catalog
from tasks.engines import engine


def export(args: argparse.Namespace) -> int:
    from runtimes.families.splade import read_splade_config
    from runtimes.model_files.files import encoder_ref
    from runtimes.onnx.export import export_graph
    from tasks.sources import resolve_source

    entry = load_catalog(catalog_dir(args)).get(args.model)
    if entry is None:
        print(f"{args.model!r} is not in the catalog (shoal models list)", file=sys.stderr)
        return 1
    onnx = engine("onnx").families
    if entry.adapter not in onnx:
        print(f"{entry.id} is a {entry.adapter} model; the ONNX runtime serves "
              f"{sorted(onnx)}", file=sys.stderr)
        return 1
    ref = resolve_source(entry.source)
    folder = ref
    if entry.adapter == "sparse":  # the MLM transformer may sit in a subfolder
        folder = encoder_ref(ref, read_splade_config(ref).encoder_dir)
    started = time.perf_counter()
    out = export_graph(Path(folder), entry.adapter, args.precision)
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
