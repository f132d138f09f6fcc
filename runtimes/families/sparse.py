"""SPLADE sparse embeddings, whatever computes them: a masked-LM's logits pooled into one
weight per vocabulary term.

A term's weight is the max over the text's real tokens of log(1 + relu(logit)),
which is what sentence-transformers' `SparseEncoder` (MLM transformer +
`SpladePooling(max, relu)`) computes on the same weights. A sentence-transformers
save may ask for sum pooling or the `log1p_relu` activation instead; both are
read from its files (`runtimes.families.splade`). Results keep only the non-zero terms,
so a vector costs what the text says, not the vocabulary's size.

The family's logic is here, once: the files, prompts and lowercasing, the checks, the
forward passes' size and the results. An engine supplies a `MaskedLM`: the model's
tokenizer and limits, and the pooled term weights of a batch (`runtimes.pytorch.sparse`
pools on the device, `runtimes.onnx.sparse` on the host with `splade_weights`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from runtimes.child_side.adapter import Adapter
from runtimes.families.splade import (
    LOGITS_BUDGET,
    SpladeConfig,
    check_sparse_request,
    check_vocabulary,
    nonzero_terms,
    read_splade_config,
    sparse_results,
)
from runtimes.families.st_config import read_st_config
from runtimes.model_files.files import encoder_ref
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest


def forward_tokens(chunk_tokens: int, vocab_size: int) -> int:
    """Padded tokens per pass: the logits (tokens x vocabulary) stay in LOGITS_BUDGET."""
    return max(1, min(chunk_tokens, LOGITS_BUDGET // vocab_size))


class MaskedLM(Protocol):
    """What an engine supplies for the sparse family: a masked LM's tokenizer (called as
    transformers' tokenizers are), its limits, and pooled term weights."""

    tokenizer: Any
    max_seq_length: int
    vocab_size: int

    def weights(self, input_ids: list[list[int]], token_type_ids: list[list[int]] | None,
                budget: int, splade: SpladeConfig
                ) -> Iterable[tuple[list[int], np.ndarray]]:
        """Per chunk of at most `budget` padded tokens: its rows' places in the input and
        their (rows, vocabulary) float32 term weights, pooled as `splade` says."""
        ...


class SparseAdapter(Adapter):
    """Catalog `adapter: sparse`: SPLADE vectors over the model's vocabulary. An engine's
    subclass gives the `MaskedLM` of the model (`masked_lm`)."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.splade = read_splade_config(ref)
        folder = encoder_ref(ref, self.splade.encoder_dir)
        st = read_st_config(Path(folder))
        self.do_lower_case = st.do_lower_case
        self.encoder = self.masked_lm(folder, st.max_seq_length)
        self.tokenizer = self.encoder.tokenizer
        self.max_seq_length = self.encoder.max_seq_length
        self.vocab_size = self.encoder.vocab_size
        check_vocabulary(entry, self.vocab_size)
        self.forward_tokens = forward_tokens(self.chunk_tokens, self.vocab_size)

    @abstractmethod
    def masked_lm(self, folder: str, max_seq_length: int | None) -> MaskedLM:
        """The engine's masked LM in `folder` (the transformer's, inside a
        sentence-transformers save), within the entry's `max_seq_length`, else
        `max_seq_length` (its files'), else the tokenizer's."""

    def _texts(self, parsed: ParsedRequest) -> list[str]:
        return self.prompted(parsed, self.do_lower_case)

    def check(self, parsed: ParsedRequest) -> ParsedRequest:
        check_sparse_request(parsed, self.entry, self.tokenizer, self._texts(parsed),
                             self.max_seq_length)
        return parsed

    def embed(self, input_ids: list[list[int]],
              token_type_ids: list[list[int]] | None) -> list[dict[str, list]]:
        """One `{"indices", "values"}` per text (its non-zero terms, ascending), in order."""
        out: list[dict[str, list]] = [{}] * len(input_ids)
        for chunk, weights in self.encoder.weights(input_ids, token_type_ids,
                                                   self.forward_tokens, self.splade):
            for row, i in zip(weights, chunk, strict=True):
                out[i] = nonzero_terms(row)
        return out

    def run(self, prepared: list[ParsedRequest]) -> list[dict[str, Any]]:
        texts = [t for parsed in prepared for t in self._texts(parsed)]
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_seq_length,
                                 padding=False)
        input_ids = encoded["input_ids"]
        vectors = self.embed(input_ids, encoded.get("token_type_ids"))
        return sparse_results(prepared, vectors, input_ids, self.vocab_size)
