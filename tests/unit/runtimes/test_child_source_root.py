"""The runtime process finds shoal's packages, and only them, first on its path.

`ProcessRuntime` puts the folder that holds the `runtimes` package first on its child's
PYTHONPATH. When the module moved one folder deeper the folder named became `runtimes/`
itself, and `import onnx` in the child's ONNX export found `runtimes/onnx`: the export
failed with "module 'onnx' has no attribute 'load_model_from_string'"."""

from __future__ import annotations

from pathlib import Path

import runtimes
from runtimes.worker_side import process


def test_the_childs_source_root_is_the_folder_that_holds_the_packages():
    root = Path(process._SOURCE_ROOT)
    assert root == Path(runtimes.__file__).resolve().parents[1]
    assert {"runtimes", "tasks", "batching"} <= {p.name for p in root.iterdir()}
    # No folder on it may shadow an installed package by an engine's folder name.
    assert not (root / "onnx").exists() and not (root / "sglang").exists()
