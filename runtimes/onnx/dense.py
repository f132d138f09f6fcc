"""Dense text embeddings on ONNX Runtime: the dense family's `Embedder`
(`runtimes.families.dense`), the graph's last hidden state pooled on the host.

The same results as `runtimes.pytorch.dense` on the same weights: the family's logic is
one, only the forward pass differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtimes.families import dense
from runtimes.families.dense import DenseConfig, Tokenized, pool
from runtimes.families.token_ids import vocabulary
from runtimes.onnx.adapter import OnnxAdapter
from runtimes.onnx.session import OnnxModel

Chunks = list[tuple[list[int], dict[str, np.ndarray]]]


class OnnxEmbedder:
    """A dense model's session, pooling its hidden states as `pooling` says."""

    def __init__(self, model: OnnxModel, pooling: str, chunk_tokens: int) -> None:
        self.model = model
        self.pooling = pooling
        self.chunk_tokens = chunk_tokens
        self.tokenizer = model.tokenizer
        self.max_seq_length = model.max_length
        self.dims = int(model.config.hidden_size)
        # Which ids a tokens item may hold: the tokenizer's, within the embedding's rows.
        self.vocab = vocabulary(self.tokenizer, model.config.vocab_size)

    def chunks(self, tokens: Tokenized) -> Chunks:
        return self.model.chunks(tokens.input_ids, tokens.token_type_ids, self.chunk_tokens)

    def forward(self, chunks: Chunks, loras: Sequence[str | None] | None = None) -> np.ndarray:
        # ONNX Runtime's run returns once its outputs are on the host: pooled here at once.
        out = np.empty((sum(len(chunk) for chunk, _ in chunks), self.dims), dtype=np.float32)
        for chunk, inputs in chunks:
            hidden = self.model.run(inputs)
            out[chunk] = pool(hidden, inputs["attention_mask"], self.pooling)
        return out

    def gather(self, chunks: Chunks, output: np.ndarray, n: int) -> np.ndarray:
        return output


class OnnxDenseAdapter(OnnxAdapter, dense.DenseAdapter):
    """Catalog `adapter: dense` on ONNX Runtime."""

    family = "dense"

    def embedder(self, ref: str, config: DenseConfig) -> OnnxEmbedder:
        self.model = self.open_model(ref, self.entry.max_seq_length, config.max_seq_length)
        return OnnxEmbedder(self.model, config.pooling, self.chunk_tokens)
