"""ColBERT-style multi-vector embeddings: one unit vector per token, for late interaction.

A BERT-like encoder's token states go through the model's bias-free linear
projection down to `dims` and are L2-normalised one by one; a document keeps a
vector per real token, and a query is padded with [MASK] tokens to a fixed
length (32), every position a vector, which is ColBERT's query augmentation.

The projection is read from either checkpoint layout in use: a
sentence-transformers / PyLate `Dense` module folder listed in `modules.json`,
or the Stanford `colbert-ir/colbertv2.0` layout, a `linear.weight` tensor next
to the encoder's weights. Query length, document length and whether the
encoder attends to the [MASK] padding are read from the model's files where
they say (PyLate, sentence-transformers and Stanford configs each name them
differently), else the defaults above, with the padding attended to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AddedToken, AutoModel, PreTrainedTokenizerBase

from runtimes.families.st_config import read_st_config
from runtimes.model_files.files import encoder_ref, model_file
from runtimes.pytorch import buckets
from runtimes.pytorch.adapter import Adapter
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.text import check_lengths, length_chunks, max_length, pad
from tasks.catalog import ModelEntry, Prompts
from tasks.schema import ParsedRequest, check_encode_output

QUERY_LENGTH = 32
_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")


@dataclass(frozen=True)
class ColbertConfig:
    query_length: int = QUERY_LENGTH
    attend_expansion: bool = True
    expansion_token: str | None = None  # None: the tokenizer's mask token
    document_length: int | None = None
    encoder_dir: str = ""  # the encoder's folder inside the model


@dataclass(frozen=True)
class Linear:
    weight: torch.Tensor  # (out_features, in_features)
    bias: torch.Tensor | None


def _json(path: Path | None) -> dict[str, Any]:
    return json.loads(path.read_text()) if path is not None else {}


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
    config = _json(model_file(ref, f"{folder}/config.json"))
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
        shard = _json(index).get("weight_map", {}).get("linear.weight")
        path = model_file(ref, shard) if shard else None
    else:
        path = _weights_file(ref, "")
    if path is None:
        return None
    weight = _tensors(path, ["linear.weight"]).get("linear.weight")
    return None if weight is None else Linear(weight.float(), None)


def read_colbert(ref: str) -> tuple[list[Linear], ColbertConfig]:
    """The projection (layers applied in order) and the ColBERT settings of a model."""
    layers: list[Linear] = []
    encoder_dir = ""
    modules_file = model_file(ref, "modules.json")
    for module in json.loads(modules_file.read_text()) if modules_file else []:
        kind = module.get("type", "")
        if kind.endswith(".Dense"):
            layers.append(_dense_module(ref, module["path"]))
        elif kind.endswith("Transformer"):
            encoder_dir = module.get("path", "")
    if not layers:
        linear = _stanford_linear(ref)
        layers = [linear] if linear is not None else []

    settings: dict[str, Any] = {}
    # Stanford artifact.metadata, then PyLate's, then sentence-transformers' own names.
    stanford = _json(model_file(ref, "artifact.metadata"))
    pylate = _json(model_file(ref, "config_sentence_transformers.json"))
    prefix = f"{encoder_dir}/" if encoder_dir else ""
    st = _json(model_file(ref, f"{prefix}sentence_bert_config.json"))
    expansion = st.get("query_expansion") or {}
    for key, value in (
        ("query_length", stanford.get("query_maxlen")),
        ("attend_expansion", stanford.get("attend_to_mask_tokens")),
        ("document_length", stanford.get("doc_maxlen")),
        ("query_length", pylate.get("query_length")),
        ("attend_expansion", pylate.get("attend_to_expansion_tokens")),
        ("document_length", pylate.get("document_length")),
        ("query_length", expansion.get("length") or st.get("query_length")),
        ("attend_expansion", expansion.get("attend")),
        ("expansion_token", expansion.get("token")),
        ("document_length", st.get("document_length")),
    ):
        if value is not None:
            settings[key] = value
    return layers, ColbertConfig(**settings, encoder_dir=encoder_dir)


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


class MultiVectorAdapter(Adapter):
    """Catalog `adapter: multivector`: per-token unit vectors of the entry's `dims`."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        layers, self.colbert = read_colbert(ref)
        if not layers:
            raise ValueError(
                f"{entry.id}: no ColBERT projection in {ref}: expected a Dense module listed in "
                "modules.json (sentence-transformers / PyLate) or a 'linear.weight' tensor in "
                "model.safetensors (colbert-ir/colbertv2.0)")
        model_ref = encoder_ref(ref, self.colbert.encoder_dir)
        self.tokenizer, self.model, self.pad_id = load_model(AutoModel, model_ref, self.device,
                                                             self.dtype, self.chunk_tokens)
        keep_prompt_markers(self.tokenizer, entry.prompts)

        hidden = int(self.model.config.hidden_size)
        if layers[0].weight.shape[1] != hidden:
            raise ValueError(f"{entry.id}: the projection takes {layers[0].weight.shape[1]} "
                             f"features, but the encoder gives {hidden}")
        out_features = int(layers[-1].weight.shape[0])
        if out_features != entry.dims:
            raise ValueError(f"{entry.id}: the projection gives {out_features}-dim vectors, but "
                             f"the catalog entry says dims: {entry.dims}; set dims to "
                             f"{out_features}")
        self.layers = [Linear(layer.weight.to(self.device),
                              None if layer.bias is None else layer.bias.to(self.device))
                       for layer in layers]
        self.dims = out_features

        st = read_st_config(Path(model_ref))
        self.do_lower_case = st.do_lower_case
        self.document_length = max_length(self.tokenizer, self.model.config, entry.max_seq_length,
                                          self.colbert.document_length, st.max_seq_length)
        self.query_length = max_length(self.tokenizer, self.model.config,
                                       self.colbert.query_length)
        token = self.colbert.expansion_token or self.tokenizer.mask_token
        expansion_id = self.tokenizer.convert_tokens_to_ids(token) if token else None
        if expansion_id is None or expansion_id == self.tokenizer.unk_token_id:
            raise ValueError(f"{entry.id}: the tokenizer has no {token or 'mask'} token to pad "
                             "queries with")
        self.expansion_id = int(expansion_id)

    def _texts(self, parsed: ParsedRequest) -> list[str]:
        return self.prompted(parsed, self.do_lower_case)

    def _limit(self, parsed: ParsedRequest) -> int:
        return self.query_length if parsed.options.is_query else self.document_length

    def check(self, parsed: ParsedRequest) -> ParsedRequest:
        options = parsed.options
        if self.dims != self.entry.dims:  # else the entry's parse checked it all already
            check_encode_output(options, self.entry.id, "multivector", self.dims)
        if not options.truncate:
            encoded = self.tokenizer(self._texts(parsed), truncation=False, padding=False)
            check_lengths([len(ids) for ids in encoded["input_ids"]], self._limit(parsed))
        return parsed

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = F.linear(hidden, layer.weight, layer.bias)
        return F.normalize(hidden, dim=-1)

    @torch.inference_mode()
    def _embed(self, input_ids: list[list[int]], token_type_ids: list[list[int]] | None,
               attention: list[list[int]]) -> list[np.ndarray]:
        """(len(ids), dims) float32 vectors per sequence, in order."""
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

    def run(self, prepared: list[ParsedRequest]) -> list[dict[str, Any]]:
        input_ids: list[list[int]] = []
        types: list[list[int]] | None = []
        attention: list[list[int]] = []
        used: list[int] = []
        for parsed in prepared:
            encoded = self.tokenizer(self._texts(parsed), truncation=True,
                                     max_length=self._limit(parsed), padding=False)
            type_ids = encoded.get("token_type_ids")
            if type_ids is None:
                types = None
            for j, ids in enumerate(encoded["input_ids"]):
                n = len(ids)
                used.append(n)
                extra = self.query_length - n if parsed.options.is_query else 0
                input_ids.append(list(ids) + [self.expansion_id] * extra)
                attention.append([1] * n + [int(self.colbert.attend_expansion)] * extra)
                if types is not None:
                    types.append(list(type_ids[j]) + [0] * extra)
        vectors = self._embed(input_ids, types, attention)
        results, offset = [], 0
        for parsed in prepared:
            n = len(parsed.items)
            rows = vectors[offset : offset + n]
            results.append({
                "output": "multivector",
                "dims": self.dims,
                "count": n,
                "dtype": "float32",
                "lengths": [len(r) for r in rows],
                "embeddings": np.ascontiguousarray(np.concatenate(rows), dtype="<f4").tobytes(),
                "usage": {"tokens": sum(used[offset : offset + n])},
            })
            offset += n
        return results
