"""ColBERT-style multi-vector embeddings, whatever computes them: one unit vector per
token, for late interaction.

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

The family's logic is here, once: the files' settings, prompts and lowercasing, the
limits and checks, the query expansion and the results. An engine's subclass supplies
the primitive (`MultiVectorAdapter.load` and `_embed`): the encoder with its projection,
and each sequence's projected unit vectors (`runtimes.pytorch.multivector`).
"""

from __future__ import annotations

import json
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtimes.child_side.adapter import Adapter
from runtimes.families.st_config import read_st_config
from runtimes.families.text import check_lengths, max_length
from runtimes.model_files.files import encoder_ref, model_file
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest, check_encode_output

QUERY_LENGTH = 32


@dataclass(frozen=True)
class ColbertConfig:
    query_length: int = QUERY_LENGTH
    attend_expansion: bool = True
    expansion_token: str | None = None  # None: the tokenizer's mask token
    document_length: int | None = None
    encoder_dir: str = ""  # the encoder's folder inside the model


def read_json(path: Path | None) -> dict[str, Any]:
    """A model file's JSON (`runtimes.model_files.files.model_file`'s path); {} if absent."""
    return json.loads(path.read_text()) if path is not None else {}


def read_colbert(ref: str) -> tuple[list[str], ColbertConfig]:
    """The projection's Dense module folders (applied in order; none: the Stanford layout)
    and the ColBERT settings of a model."""
    dense: list[str] = []
    encoder_dir = ""
    modules_file = model_file(ref, "modules.json")
    for module in json.loads(modules_file.read_text()) if modules_file else []:
        kind = module.get("type", "")
        if kind.endswith(".Dense"):
            dense.append(module["path"])
        elif kind.endswith("Transformer"):
            encoder_dir = module.get("path", "")

    settings: dict[str, Any] = {}
    # Stanford artifact.metadata, then PyLate's, then sentence-transformers' own names.
    stanford = read_json(model_file(ref, "artifact.metadata"))
    pylate = read_json(model_file(ref, "config_sentence_transformers.json"))
    prefix = f"{encoder_dir}/" if encoder_dir else ""
    st = read_json(model_file(ref, f"{prefix}sentence_bert_config.json"))
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
    return dense, ColbertConfig(**settings, encoder_dir=encoder_dir)


class MultiVectorAdapter(Adapter):
    """Catalog `adapter: multivector`: per-token unit vectors of the entry's `dims`."""

    tokenizer: Any  # set by `load`, called as transformers' tokenizers are

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        dense, self.colbert = read_colbert(ref)
        model_ref = encoder_ref(ref, self.colbert.encoder_dir)
        config, out_features = self.load(ref, model_ref, dense)
        if out_features != entry.dims:
            raise ValueError(f"{entry.id}: the projection gives {out_features}-dim vectors, but "
                             f"the catalog entry says dims: {entry.dims}; set dims to "
                             f"{out_features}")
        self.dims = out_features

        st = read_st_config(Path(model_ref))
        self.do_lower_case = st.do_lower_case
        self.document_length = max_length(self.tokenizer, config, entry.max_seq_length,
                                          self.colbert.document_length, st.max_seq_length)
        self.query_length = max_length(self.tokenizer, config, self.colbert.query_length)
        token = self.colbert.expansion_token or self.tokenizer.mask_token
        expansion_id = self.tokenizer.convert_tokens_to_ids(token) if token else None
        if expansion_id is None or expansion_id == self.tokenizer.unk_token_id:
            raise ValueError(f"{entry.id}: the tokenizer has no {token or 'mask'} token to pad "
                             "queries with")
        self.expansion_id = int(expansion_id)

    @abstractmethod
    def load(self, ref: str, model_ref: str, dense: list[str]) -> tuple[Any, int]:
        """Set `tokenizer` and load the encoder in `model_ref` with the projection (the
        Dense module folders of `ref` in `dense`, in order; none: the Stanford layout's
        `linear.weight`): the encoder's config (max_position_embeddings) and the width
        of the projected vectors. ValueError if there is no projection, or it does not fit
        the encoder."""

    @abstractmethod
    def _embed(self, input_ids: list[list[int]], token_type_ids: list[list[int]] | None,
               attention: list[list[int]]) -> list[np.ndarray]:
        """(len(ids), dims) float32 unit vectors per sequence, in order."""

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
