"""The PyTorch adapters' base: the runtime's adapter contract (`runtimes.child_side.adapter`) with
the torch dtype of the entry's precision."""

from __future__ import annotations

from typing import Any

from runtimes.child_side.adapter import Adapter as BaseAdapter
from runtimes.child_side.adapter import probe_image, probe_kwargs
from runtimes.model_files.precision import torch_dtype
from tasks.catalog import ModelEntry

__all__ = ["Adapter", "probe_image", "probe_kwargs"]


class Adapter(BaseAdapter):
    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.dtype = torch_dtype(self.precision)
