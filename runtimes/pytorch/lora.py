"""LoRA adapters (peft format) on one loaded model, and forward passes that mix them.

A `LoraSet` owns the model's forward: an adapter that serves LoRAs calls
`LoraSet.forward(loras, **inputs)` instead of the model, giving the LoRA of each
row of the batch (None for the base model). Requests for different LoRAs of one
model, and requests without one, then run in one forward pass: peft's mixed
adapter batches (`adapter_names=[...]`, one name per row, "__base__" for rows
without a LoRA) apply each LoRA to its own rows only.

Until the first LoRA loads the model is not wrapped at all: the forward is the
plain model's, and peft is not even imported. The first load wraps it in a
`PeftModel` (which puts LoRA layers in place of the targeted modules); unloading
the last one takes every LoRA layer out again (`unload`), so the model is what it
was before.

Loads and unloads may come from another thread than the forward passes (the
runtime loads beside serving): one lock makes each forward pass and each load
or unload whole. The caller never unloads a LoRA that a running batch uses.

Not served: DoRA (peft has no mixed batches for it) and adapter types other than
LoRA; `load` refuses them before touching the model.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch

BASE = "__base__"  # peft's name for "no adapter" in `adapter_names`


class LoraSet:
    """The LoRA adapters loaded on `model`, by the catalog's names."""

    def __init__(self, model: torch.nn.Module, model_id: str = "this model") -> None:
        self.model = model
        self.model_id = model_id
        self.peft: Any = None  # the PeftModel around `model` while any LoRA is loaded
        # Catalog name -> peft adapter name. Catalog names may hold '.' and '/', which a
        # torch module name may not, so peft sees names of its own.
        self._peft_names: dict[str, str] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    @property
    def names(self) -> set[str]:
        return set(self._peft_names)

    def forward(self, loras: Sequence[str | None] | None, /, **inputs: Any) -> Any:
        """One forward pass of the model on `inputs` (`input_ids` among them), row i with
        LoRA `loras[i]` (None, or `loras` None: the base model). Every LoRA named must be
        loaded."""
        with self._lock:
            if self.peft is None:
                if loras is not None and any(loras):
                    raise KeyError(f"LoRA {next(n for n in loras if n)!r} of {self.model_id} "
                                   "is not loaded")
                return self.model(**inputs)
            rows = inputs["input_ids"].shape[0]
            names = [BASE] * rows if loras is None else \
                [BASE if n is None else self._peft_names[n] for n in loras]
            return self.peft(**inputs, adapter_names=names)

    def load(self, name: str, ref: str) -> int:
        """Load the peft LoRA adapter in the local directory `ref` as `name`: the bytes its
        tensors take on the model's device. ValueError if `name` is loaded already or the
        adapter is no LoRA this can serve; the model is left as it was on any failure."""
        from peft import LoraConfig, PeftConfig

        with self._lock:
            if name in self._peft_names:
                raise ValueError(f"LoRA {name!r} of {self.model_id} is loaded already")
            config = PeftConfig.from_pretrained(ref)
            if not isinstance(config, LoraConfig):
                raise ValueError(f"{ref} holds a {config.peft_type} adapter, not a LoRA")
            if config.use_dora:
                raise ValueError(f"{ref} is a DoRA adapter, which cannot share a batch with "
                                 "other adapters (peft mixed batches)")
            peft_name = f"shoal{next(self._numbers)}"
            if self.peft is None:
                self._wrap(config, ref, peft_name)
            else:
                try:
                    self.peft.load_adapter(ref, peft_name, torch_device=self._device())
                except BaseException:
                    if peft_name in self.peft.peft_config:
                        self.peft.delete_adapter(peft_name)
                    raise
            self.peft.eval()
            self._peft_names[name] = peft_name
            return self._bytes(peft_name)

    def unload(self, name: str) -> None:
        """Take the LoRA `name` off the model; the last one takes peft's wrapper with it.
        KeyError if it is not loaded."""
        with self._lock:
            peft_name = self._peft_names.pop(name, None)
            if peft_name is None:
                raise KeyError(f"LoRA {name!r} of {self.model_id} is not loaded")
            if self._peft_names:
                self.peft.delete_adapter(peft_name)
            else:
                # Every LoRA layer goes back to the module it wrapped: the plain model again.
                self.peft.unload()
                self.peft = None

    def _wrap(self, config: Any, ref: str, peft_name: str) -> None:
        """The first LoRA: wrap the model in a plain PeftModel (whatever task the adapter
        was trained for: its forward passes every input through unchanged)."""
        from peft import PeftModel

        config.task_type = None
        config.inference_mode = True  # frozen, as PeftModel.from_pretrained leaves it
        peft = None
        try:
            peft = PeftModel(self.model, config, adapter_name=peft_name)
            peft.load_adapter(ref, peft_name, torch_device=self._device())
        except BaseException:
            if peft is not None:
                peft.unload()
            else:
                _strip_lora_layers(self.model)
            raise
        self.peft = peft

    def _device(self) -> str:
        """Where the model is: the adapter's file is read straight there (peft would read it
        onto the first GPU, whatever the model's device)."""
        return str(next(self.model.parameters()).device)

    def _bytes(self, peft_name: str) -> int:
        """Bytes of the parameters that belong to one peft adapter (its lora_A, lora_B,
        embedding factors, modules to save): their names hold the adapter's name."""
        return sum(p.numel() * p.element_size() for n, p in self.peft.named_parameters()
                   if peft_name in n.split("."))


def _strip_lora_layers(model: torch.nn.Module) -> None:
    """Put back the module each peft layer wraps, for a wrap that failed half-way."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for key, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = key.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
