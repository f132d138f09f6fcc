"""SPLADE sparse embeddings on PyTorch: the sparse family's `MaskedLM`
(`runtimes.families.sparse`), the logits pooled into term weights on the device, so only
(texts x vocabulary) weights come back to the host, never (tokens x vocabulary) logits."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from transformers import AutoModelForMaskedLM

from runtimes.families import sparse
from runtimes.families.sparse import forward_tokens
from runtimes.families.splade import SpladeConfig
from runtimes.model_files.precision import torch_dtype
from runtimes.pytorch import buckets
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.text import max_length, padded_chunks


class TorchMaskedLM:
    """A masked LM on `device`, its passes bucketed at the family's tokens per pass."""

    def __init__(self, folder: str, *, device: str, dtype: torch.dtype, chunk_tokens: int,
                 max_seq_length: tuple[int | None, ...]) -> None:
        self.device = device
        self.tokenizer, self.model, self.pad_id = load_model(
            AutoModelForMaskedLM, folder, device, dtype,
            bucket_tokens=lambda config: forward_tokens(chunk_tokens, int(config.vocab_size)),
            bucket_width=next((n for n in max_seq_length if n), None))
        self.max_seq_length = max_length(self.tokenizer, self.model.config, *max_seq_length)
        self.vocab_size = int(self.model.config.vocab_size)

    @staticmethod
    def _pool(logits: torch.Tensor, mask: torch.Tensor, splade: SpladeConfig) -> torch.Tensor:
        weights = logits.float().relu_().log1p_()
        if splade.activation == "log1p_relu":
            weights = weights.log1p_()
        # Weights are >= 0, so zeroing the padding keeps it out of a max as well as a sum.
        weights.mul_(mask.unsqueeze(-1).to(weights.dtype))
        return weights.amax(dim=1) if splade.pooling == "max" else weights.sum(dim=1)

    def weights(self, input_ids: list[list[int]], token_type_ids: list[list[int]] | None,
                budget: int, splade: SpladeConfig) -> Iterator[tuple[list[int], np.ndarray]]:
        for chunk, inputs in padded_chunks(input_ids, token_type_ids, self.pad_id, self.device,
                                           budget):
            with torch.inference_mode():
                logits = buckets.forward(self.model, inputs, "logits")
                pooled = self._pool(logits, inputs["attention_mask"], splade).cpu()
            yield chunk, pooled.numpy()


class SparseAdapter(sparse.SparseAdapter):
    """Catalog `adapter: sparse` on PyTorch."""

    encoder: TorchMaskedLM

    @property
    def model(self) -> torch.nn.Module:
        """The masked LM's module (a property: the walks of an adapter's tensors find it
        once, through `encoder`)."""
        return self.encoder.model

    def masked_lm(self, folder: str, max_seq_length: int | None) -> TorchMaskedLM:
        return TorchMaskedLM(folder, device=self.device, dtype=torch_dtype(self.precision),
                             chunk_tokens=self.chunk_tokens,
                             max_seq_length=(self.entry.max_seq_length, max_seq_length))
