"""Files of a model directory beyond the weights transformers loads itself."""

from __future__ import annotations

from pathlib import Path


def model_file(ref: str, name: str) -> Path | None:
    """A file of the model directory `ref`, or None if it has none."""
    path = Path(ref) / name
    return path if path.is_file() else None


def encoder_ref(ref: str, folder: str) -> str:
    """What from_pretrained reads for the transformer: the model itself, or the subfolder a
    sentence-transformers save keeps it in."""
    return str(Path(ref) / folder) if folder else ref
