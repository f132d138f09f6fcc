"""SPLADE sparse embeddings on ONNX Runtime: the sparse family's `MaskedLM`
(`runtimes.families.sparse`), the graph's masked-LM logits pooled into term weights on
the host (`runtimes.families.splade.splade_weights`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from runtimes.families import sparse
from runtimes.families.splade import SpladeConfig, splade_weights
from runtimes.onnx.adapter import OnnxAdapter
from runtimes.onnx.session import OnnxModel


class OnnxMaskedLM:
    """A masked LM's session."""

    def __init__(self, model: OnnxModel) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.max_seq_length = model.max_length
        self.vocab_size = int(model.config.vocab_size)

    def weights(self, input_ids: list[list[int]], token_type_ids: list[list[int]] | None,
                budget: int, splade: SpladeConfig) -> Iterator[tuple[list[int], np.ndarray]]:
        for chunk, inputs in self.model.chunks(input_ids, token_type_ids, budget):
            logits = self.model.run(inputs)
            yield chunk, splade_weights(logits, inputs["attention_mask"], splade)


class OnnxSparseAdapter(OnnxAdapter, sparse.SparseAdapter):
    """Catalog `adapter: sparse` on ONNX Runtime."""

    family = "sparse"

    def masked_lm(self, folder: str, max_seq_length: int | None) -> OnnxMaskedLM:
        self.model = self.open_model(folder, self.entry.max_seq_length, max_seq_length)
        return OnnxMaskedLM(self.model)
