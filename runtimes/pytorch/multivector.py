"""ColBERT-style multi-vector embeddings on PyTorch: the multivector family's primitive
(`runtimes.families.multivector`), the encoder and its projection on the device, each
token's state projected and L2-normalised there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AddedToken, AutoModel, PreTrainedTokenizerBase

from runtimes.families import multivector
from runtimes.model_files.files import model_file
from runtimes.model_files.precision import torch_dtype
from runtimes.pytorch import buckets
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.text import length_chunks, pad
from tasks.catalog import Prompts

_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")


@dataclass(frozen=True)
class Linear:
    weight: torch.Tensor  # (out_features, in_features)
    bias: torch.Tensor | None


def _tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors (or legacy pickled) weights file."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            return {k: f.get_tensor(k) for k in keys if k in present}
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: state[k] for k in keys if k in state}


def _weights_file(ref: str, folder: str) -> Path | None:
    prefix = f"{folder}/" if folder else ""
    return (model_file(ref, f"{prefix}model.safetensors")
            or model_file(ref, f"{prefix}pytorch_model.bin"))


def _dense_module(ref: str, folder: str) -> Linear:
    """A sentence-transformers Dense folder: config.json plus `linear.weight` (and bias)."""
    config = multivector.read_json(model_file(ref, f"{folder}/config.json"))
    activation = config.get("activation_function")
    if activation is not None and activation not in _IDENTITY:
        raise ValueError(f"{ref}: Dense module {folder!r} applies {activation}; the multivector "
                         "adapter supports linear projections only")
    weights_file = _weights_file(ref, folder)
    tensors = _tensors(weights_file, ["linear.weight", "linear.bias"]) if weights_file else {}
    if "linear.weight" not in tensors:
        raise ValueError(f"{ref}: Dense module {folder!r} has no 'linear.weight' tensor")
    weight = tensors["linear.weight"].float()
    expected = (config.get("out_features"), config.get("in_features"))
    if None not in expected and tuple(weight.shape) != expected:
        raise ValueError(f"{ref}: Dense module {folder!r} holds a {tuple(weight.shape)} weight, "
                         f"but its config says (out, in) = {expected}")
    bias = tensors.get("linear.bias") if config.get("bias", False) else None
    return Linear(weight, None if bias is None else bias.float())


def _stanford_linear(ref: str) -> Linear | None:
    """`linear.weight` next to the encoder's weights (colbert-ir/colbertv2.0), if there."""
    index = model_file(ref, "model.safetensors.index.json")
    if index is not None:
        shard = multivector.read_json(index).get("weight_map", {}).get("linear.weight")
        path = model_file(ref, shard) if shard else None
    else:
        path = _weights_file(ref, "")
    if path is None:
        return None
    weight = _tensors(path, ["linear.weight"]).get("linear.weight")
    return None if weight is None else Linear(weight.float(), None)


def keep_prompt_markers(tokenizer: PreTrainedTokenizerBase, prompts: Prompts) -> None:
    """Make a prompt's marker token (ColBERT's "[unused0] ") one token, as trained.

    BERT tokenizers split a vocabulary entry like "[unused0]" on its brackets unless
    it is registered; registering an existing entry adds no new id.
    """
    vocab = tokenizer.get_vocab()
    for prompt in (prompts.query, prompts.document):
        words = prompt.split()
        if words and words[0] in vocab and tokenizer.tokenize(words[0]) != [words[0]]:
            tokenizer.add_tokens([AddedToken(words[0], special=True, normalized=False)])


def read_projection(ref: str, dense: list[str]) -> list[Linear]:
    """The projection's layers (applied in order): the Dense module folders `dense`, else
    the Stanford layout's `linear.weight` (none if neither is there)."""
    if dense:
        return [_dense_module(ref, folder) for folder in dense]
    linear = _stanford_linear(ref)
    return [linear] if linear is not None else []


class MultiVectorAdapter(multivector.MultiVectorAdapter):
    """Catalog `adapter: multivector` on PyTorch."""

    def load(self, ref: str, model_ref: str, dense: list[str]) -> tuple[Any, int]:
        layers = read_projection(ref, dense)
        if not layers:
            raise ValueError(
                f"{self.entry.id}: no ColBERT projection in {ref}: expected a Dense module "
                "listed in modules.json (sentence-transformers / PyLate) or a 'linear.weight' "
                "tensor in model.safetensors (colbert-ir/colbertv2.0)")
        self.tokenizer, self.model, self.pad_id = load_model(
            AutoModel, model_ref, self.device, torch_dtype(self.precision), self.chunk_tokens)
        keep_prompt_markers(self.tokenizer, self.entry.prompts)

        hidden = int(self.model.config.hidden_size)
        if layers[0].weight.shape[1] != hidden:
            raise ValueError(f"{self.entry.id}: the projection takes "
                             f"{layers[0].weight.shape[1]} features, but the encoder gives "
                             f"{hidden}")
        # On the adapter itself: the host-memory tier's walk of its tensors finds them
        # (`runtimes.pytorch.offload`).
        self.layers = [Linear(layer.weight.to(self.device),
                              None if layer.bias is None else layer.bias.to(self.device))
                       for layer in layers]
        return self.model.config, int(layers[-1].weight.shape[0])

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = F.linear(hidden, layer.weight, layer.bias)
        return F.normalize(hidden, dim=-1)

    @torch.inference_mode()
    def _embed(self, input_ids: list[list[int]], token_type_ids: list[list[int]] | None,
               attention: list[list[int]]) -> list[np.ndarray]:
        out: list[np.ndarray] = [np.empty((0, self.dims), np.float32)] * len(input_ids)
        for chunk in length_chunks([len(ids) for ids in input_ids], self.chunk_tokens):
            inputs = {
                "input_ids": pad([input_ids[i] for i in chunk], self.pad_id),
                "attention_mask": pad([attention[i] for i in chunk], 0),
            }
            if token_type_ids is not None:
                inputs["token_type_ids"] = pad([token_type_ids[i] for i in chunk], 0)
            inputs = {k: v.to(self.device) for k, v in inputs.items()}
            hidden = buckets.forward(self.model, inputs, "last_hidden_state").float()
            vectors = self._project(hidden).cpu().numpy()
            for row, i in enumerate(chunk):
                out[i] = vectors[row, : len(input_ids[i])]
        return out
