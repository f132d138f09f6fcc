"""Dense text embeddings on ONNX Runtime: the graph's last hidden state, pooled here.

The same results as `runtimes.pytorch.dense` on the same weights: the
sentence-transformers files' pooling, normalisation, length and lowercasing, the
entry's prompts, Matryoshka dimensions and output dtypes (`runtimes.families.vectors`), and
token-id items beside texts (`runtimes.families.token_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtimes.families.st_config import read_st_config
from runtimes.families.text import check_lengths
from runtimes.families.token_ids import (
    Input,
    encode_inputs,
    has_tokens,
    input_lengths,
    vocabulary,
    with_token_ids,
)
from runtimes.families.vectors import dense_results
from runtimes.onnx.adapter import OnnxAdapter
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest, check_encode_output


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """(rows, width) float32 vectors of (rows, tokens, width) hidden states."""
    if pooling == "cls":
        return hidden[:, 0].astype(np.float32)
    if pooling == "lasttoken":
        last = mask.sum(axis=1) - 1
        return hidden[np.arange(hidden.shape[0]), last].astype(np.float32)
    weights = mask.astype(np.float32)
    # A batched matrix product sums the masked rows without a rows x tokens x width copy.
    summed = np.matmul(weights[:, None, :], hidden.astype(np.float32, copy=False))[:, 0]
    return summed / np.maximum(weights.sum(axis=1, keepdims=True), 1e-9)


@dataclass(frozen=True, slots=True)
class _Planned:
    prepared: list[ParsedRequest]
    input_ids: list[list[int]]
    chunks: list[tuple[list[int], dict[str, np.ndarray]]]


class OnnxDenseAdapter(OnnxAdapter):
    """Catalog `adapter: dense` on ONNX Runtime."""

    family = "dense"

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        st = read_st_config(Path(ref))
        self.model = self.open_model(ref, entry.max_seq_length, st.max_seq_length)
        self.tokenizer = self.model.tokenizer
        self.pooling = entry.pooling or st.pooling or "mean"
        self.normalize = st.normalize if entry.normalize is None else entry.normalize
        self.do_lower_case = st.do_lower_case
        self.dims = int(self.model.config.hidden_size)
        # Which ids a tokens item may hold: the tokenizer's, within the embedding's rows.
        self.vocab = vocabulary(self.tokenizer, self.model.config.vocab_size)

    def _texts(self, parsed: ParsedRequest) -> list[str]:
        return self.prompted(parsed, self.do_lower_case)

    def check(self, parsed: ParsedRequest) -> ParsedRequest:
        if self.dims != self.entry.dims:  # else the entry's parse checked it all already
            check_encode_output(parsed.options, self.entry.id, "dense", self.dims)
        tokens = has_tokens(parsed.items)
        if tokens:
            self.vocab.check(parsed.items, self.entry.id)
        if not parsed.options.truncate:
            ids = self.tokenizer(self._texts(parsed), truncation=False)["input_ids"]
            lengths = [len(row) for row in ids]
            check_lengths(input_lengths(lengths, parsed.items) if tokens else lengths,
                          self.model.max_length)
        return parsed

    def run(self, prepared: list[ParsedRequest]) -> list[dict[str, Any]]:
        planned = self.plan(prepared)
        return self.finish(planned, self.forward(planned))

    def plan(self, prepared: list[ParsedRequest]) -> _Planned:
        texts: list[Input] = [t for parsed in prepared
                              for t in with_token_ids(self._texts(parsed), parsed.items)]
        input_ids, token_type_ids = encode_inputs(self.tokenizer, texts,
                                                  self.model.max_length, self.vocab)
        return _Planned(prepared, input_ids,
                        self.model.chunks(input_ids, token_type_ids, self.chunk_tokens))

    def forward(self, planned: _Planned) -> np.ndarray:
        out = np.empty((len(planned.input_ids), self.dims), dtype=np.float32)
        for chunk, inputs in planned.chunks:
            hidden = self.model.run(inputs)
            out[chunk] = pool(hidden, inputs["attention_mask"], self.pooling)
        return out

    def finish(self, planned: _Planned, output: np.ndarray) -> list[dict[str, Any]]:
        return dense_results(planned.prepared, output, planned.input_ids, self.normalize)
