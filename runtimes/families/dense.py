"""Dense text embeddings, whatever computes them: one pooled vector per text.

The family's logic is here, once: the sentence-transformers files' pooling,
normalisation, length and lowercasing (`DenseConfig`), the entry's prompts, token-id
items beside texts (`runtimes.families.token_ids`), the length and output checks, and
the results' Matryoshka dimensions and dtypes (`runtimes.families.vectors`). An engine
supplies the primitive only, an `Embedder`: the model's tokenizer and limits, and pooled
vectors of a batch's padded chunks (`runtimes.pytorch.dense.DenseEncoder` on the device
with torch, `runtimes.onnx.dense.OnnxEmbedder` with `pool` on the host). Both then give
`sentence_transformers.SentenceTransformer.encode`'s vectors on the same weights.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from runtimes.child_side.adapter import Adapter
from runtimes.families.st_config import read_st_config
from runtimes.families.text import check_lengths
from runtimes.families.token_ids import (
    Input,
    Vocabulary,
    encode_inputs,
    has_tokens,
    input_lengths,
    with_token_ids,
)
from runtimes.families.vectors import dense_results
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest, check_encode_output


@dataclass(frozen=True, slots=True)
class DenseConfig:
    """How a dense model pools and normalises: the catalog entry's word, then the
    sentence-transformers files', then mean pooling without normalisation."""

    pooling: str
    normalize: bool
    do_lower_case: bool
    max_seq_length: int | None  # the files' limit (the catalog's comes first where given)


def dense_config(ref: str, pooling: str | None = None,
                 normalize: bool | None = None) -> DenseConfig:
    st = read_st_config(Path(ref))
    return DenseConfig(pooling or st.pooling or "mean",
                       st.normalize if normalize is None else normalize,
                       st.do_lower_case, st.max_seq_length)


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None


def lowered(texts: list[Input], lower: bool) -> list[Input]:
    """Texts lowercased for a model trained on lowercased text; a tokens item's ids are
    the model's input as they are: never lowercased."""
    if not lower:
        return texts
    return [t.lower() if type(t) is str else t for t in texts]


def tokenize(embedder: Embedder, texts: list[Input], lower: bool) -> Tokenized:
    """The model's inputs for texts and tokens items' ids (`runtimes.families.token_ids`)."""
    return Tokenized(*encode_inputs(embedder.tokenizer, lowered(texts, lower),
                                    embedder.max_seq_length, embedder.vocab))


def untruncated_lengths(tokenizer: Any, texts: list[str], lower: bool) -> list[int]:
    encoded = tokenizer(lowered(list(texts), lower), truncation=False, padding=False)
    return [len(ids) for ids in encoded["input_ids"]]


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """(rows, width) float32 vectors of (rows, tokens, width) hidden states on the host:
    what an engine whose model gives hidden states pools with."""
    if pooling == "cls":
        return hidden[:, 0].astype(np.float32)
    if pooling == "lasttoken":
        last = mask.sum(axis=1) - 1
        return hidden[np.arange(hidden.shape[0]), last].astype(np.float32)
    weights = mask.astype(np.float32)
    # A batched matrix product sums the masked rows without a rows x tokens x width copy.
    summed = np.matmul(weights[:, None, :], hidden.astype(np.float32, copy=False))[:, 0]
    return summed / np.maximum(weights.sum(axis=1, keepdims=True), 1e-9)


class Embedder(Protocol):
    """What an engine supplies for the dense family: a loaded encoder's tokenizer (called
    as transformers' tokenizers are), its limits, and pooled (not yet normalised) vectors
    in three stages, as the runtime process pipelines them (`Adapter.plan`, `forward`,
    `finish`)."""

    tokenizer: Any
    max_seq_length: int
    dims: int
    vocab: Vocabulary  # which ids a tokens item may hold

    def chunks(self, tokens: Tokenized) -> Any:
        """The host side: padded inputs per chunk (any thread)."""
        ...

    def forward(self, chunks: Any, loras: Sequence[str | None] | None = None) -> Any:
        """The device side: every chunk's pooled vectors, on their way to the host; text i
        through LoRA `loras[i]` (None: the base model) where the engine serves them."""
        ...

    def gather(self, chunks: Any, output: Any, n: int) -> np.ndarray:
        """The (n, dims) float32 vectors of `forward`, in input order, once on the host."""
        ...


@dataclass(frozen=True)
class _Planned:
    """A batch between `DenseAdapter.plan` and `finish`."""

    prepared: list[ParsedRequest]
    tokens: Tokenized
    loras: list[str | None] | None
    chunks: Any


class DenseAdapter(Adapter):
    """Catalog `adapter: dense`: the entry's prompts go before each text. An engine's
    subclass gives the `Embedder` of the model (`embedder`)."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.config = dense_config(ref, entry.pooling, entry.normalize)
        self.encoder = self.embedder(ref, self.config)
        self.dims = self.encoder.dims

    @abstractmethod
    def embedder(self, ref: str, config: DenseConfig) -> Embedder:
        """The engine's encoder of the model in `ref`, pooling as `config` says, within
        the entry's `max_seq_length`, else the config's, else the tokenizer's."""

    def check(self, parsed: ParsedRequest) -> ParsedRequest:
        if self.dims != self.entry.dims:  # else the entry's parse checked it all already
            check_encode_output(parsed.options, self.entry.id, "dense", self.dims)
        tokens = has_tokens(parsed.items)
        if tokens:
            self.encoder.vocab.check(parsed.items, self.entry.id)
        if not parsed.options.truncate:
            lengths = untruncated_lengths(self.encoder.tokenizer, self.prompted(parsed),
                                          self.config.do_lower_case)
            check_lengths(input_lengths(lengths, parsed.items) if tokens else lengths,
                          self.encoder.max_seq_length)
        return parsed

    def run(self, prepared: list[ParsedRequest]) -> list[dict[str, Any]]:
        planned = self.plan(prepared)
        return self.finish(planned, self.forward(planned))

    def plan(self, prepared: list[ParsedRequest]) -> _Planned:
        texts = [t for parsed in prepared
                 for t in with_token_ids(self.prompted(parsed), parsed.items)]
        tokens = tokenize(self.encoder, texts, self.config.do_lower_case)
        loras = None
        if self.supports_lora:
            named = [parsed.options.lora for parsed in prepared for _ in parsed.items]
            loras = named if any(named) else None
        return _Planned(prepared, tokens, loras, self.encoder.chunks(tokens))

    def forward(self, planned: _Planned) -> Any:
        return self.encoder.forward(planned.chunks, planned.loras)

    def finish(self, planned: _Planned, output: Any) -> list[dict[str, Any]]:
        tokens = planned.tokens
        vectors = self.encoder.gather(planned.chunks, output, len(tokens.input_ids))
        return dense_results(planned.prepared, vectors, tokens.input_ids,
                             self.config.normalize)
