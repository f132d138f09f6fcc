"""Files of a model directory beyond the weights transformers loads itself."""

from __future__ import annotations

from pathlib import Path

from transformers.utils import cached_file


def model_file(ref: str, name: str, local: bool) -> Path | None:
    """A file of the model, or None if it has none (a hub model's file comes from the cache
    or is downloaded like the weights are)."""
    if local:
        path = Path(ref) / name
        return path if path.is_file() else None
    found = cached_file(ref, name, _raise_exceptions_for_missing_entries=False,
                        _raise_exceptions_for_connection_errors=False)
    return Path(found) if found else None


def encoder_ref(ref: str, local: bool, folder: str) -> str:
    """What from_pretrained reads for the transformer: the model itself, or the subfolder a
    sentence-transformers save keeps it in (only a local directory can have one)."""
    if not folder:
        return ref
    if not local:
        raise ValueError(f"{ref}: its transformer is in the subfolder {folder!r}; serve it "
                         "from a local directory")
    return str(Path(ref) / folder)
