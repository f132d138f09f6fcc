"""Dense text embeddings on PyTorch: the dense family's `Embedder` (`runtimes.families.dense`).

`DenseEncoder` matches `sentence_transformers.SentenceTransformer.encode` on
the same weights: same truncation, same pooling, same normalisation. Texts
are sorted by token length and run in chunks bounded by padded tokens, so one
long text does not pad a whole batch; vectors are pooled on the device and only they
come back to the host. `DenseAdapter` is the family's adapter over it, with LoRA
adapters (texts of different LoRAs in one forward pass, `runtimes.pytorch.lora`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import AutoModel

from runtimes.families import dense
from runtimes.families.dense import DenseConfig, Tokenized, dense_config, tokenize
from runtimes.families.token_ids import Input, vocabulary
from runtimes.families.vectors import normalize_rows
from runtimes.model_files.precision import torch_dtype
from runtimes.pytorch import buckets, device_seam
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.lora import LoraSet
from runtimes.pytorch.text import (
    HostCopy,
    host_chunks,
    max_length,
    to_device,
)

__all__ = ["DenseAdapter", "DenseEncoder", "Tokenized"]


class DenseEncoder:
    """A text encoder producing one float32 vector per text."""

    def __init__(
        self,
        model_ref: str,
        *,
        device: str = "cpu",
        pooling: str | None = None,
        normalize: bool | None = None,
        max_seq_length: int | None = None,
        chunk_tokens: int = 16_384,
        dtype: torch.dtype | None = None,
    ) -> None:
        st = dense_config(model_ref, pooling, normalize)
        self.tokenizer, self.model, self.pad_id = load_model(
            AutoModel, model_ref, device, dtype, bucket_tokens=chunk_tokens,
            bucket_width=max_seq_length or st.max_seq_length)
        self.device = device
        self.pooling = st.pooling
        self.normalize = st.normalize
        self.do_lower_case = st.do_lower_case
        # The catalog wins, then the sentence-transformers files, then the tokenizer.
        self.max_seq_length = max_length(self.tokenizer, self.model.config, max_seq_length,
                                         st.max_seq_length)
        self.dims = int(self.model.config.hidden_size)
        self.chunk_tokens = chunk_tokens
        self.loras = LoraSet(self.model, model_ref)
        # Which ids a tokens item may hold: the tokenizer's, within the embedding's rows.
        self.vocab = vocabulary(self.tokenizer, getattr(
            self.model.get_input_embeddings(), "num_embeddings", None))

    def tokenize(self, texts: list[Input]) -> Tokenized:
        """The model's inputs for texts and tokens items' ids (the family's `tokenize`)."""
        return tokenize(self, texts, self.do_lower_case)

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "lasttoken":
            last = mask.sum(dim=1) - 1
            return hidden[torch.arange(hidden.shape[0]), last]
        # A batched matrix product sums the masked rows in one pass, with no rows x columns
        # x width product made first: 2-5x less CPU at 128-256 rows of MiniLM.
        weights = mask.to(hidden.dtype)
        summed = torch.bmm(weights.unsqueeze(1), hidden).squeeze(1)
        return summed / weights.sum(dim=1, keepdim=True).clamp(min=1e-9)

    def embed(self, tokens: Tokenized, loras: Sequence[str | None] | None = None) -> np.ndarray:
        """Pooled (not yet normalised) float32 vectors, in input order; text i through
        LoRA `loras[i]` (None: the base model)."""
        chunks = self.chunks(tokens)
        return self.gather(chunks, self.forward(chunks, loras), len(tokens.input_ids))

    def chunks(self, tokens: Tokenized) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
        """The host side of `embed`: padded host tensors per length-sorted chunk."""
        return host_chunks(tokens.input_ids, tokens.token_type_ids, self.pad_id, self.device,
                           self.chunk_tokens, self.max_seq_length)

    @torch.inference_mode()
    def forward(self, chunks: list[tuple[list[int], dict[str, torch.Tensor]]],
                loras: Sequence[str | None] | None = None) -> HostCopy:
        """The device side of `embed`: every chunk's pooled vectors, copied to the host
        without waiting (`gather` waits)."""
        pooled = []
        # The passes queue as a GPU's kernels do (on a stand-in device too), and the
        # HostCopy waits for them.
        with device_seam.current().queued():
            for chunk, staged_inputs in chunks:
                inputs = to_device(staged_inputs, self.device)
                names = None if loras is None else [loras[i] for i in chunk]
                hidden = buckets.forward(self.model, inputs, "last_hidden_state", names,
                                         self.loras)
                pooled.append(self._pool(hidden, inputs["attention_mask"]).float())
            return HostCopy(pooled)

    def gather(self, chunks: list[tuple[list[int], dict[str, torch.Tensor]]], copy: HostCopy,
               n: int) -> np.ndarray:
        """The vectors of `forward`, in input order."""
        out = np.empty((n, self.dims), dtype=np.float32)
        for (chunk, _), vectors in zip(chunks, copy.wait(), strict=True):
            out[chunk] = vectors.numpy()
        return out

    def encode(self, texts: list[str], *, normalize: bool | None = None) -> np.ndarray:
        vectors = self.embed(self.tokenize(texts))
        if self.normalize if normalize is None else normalize:
            vectors = normalize_rows(vectors)
        return vectors


class DenseAdapter(dense.DenseAdapter):
    """Catalog `adapter: dense` on PyTorch, with LoRA adapters."""

    encoder_class: type[DenseEncoder] = DenseEncoder
    supports_lora = True

    def embedder(self, ref: str, config: DenseConfig) -> DenseEncoder:
        encoder = self.encoder_class(
            ref, device=self.device, pooling=config.pooling,
            normalize=config.normalize, max_seq_length=self.entry.max_seq_length,
            chunk_tokens=self.chunk_tokens, dtype=torch_dtype(self.precision),
        )
        self.loras = encoder.loras
        self.loras.model_id = self.entry.id
        return encoder
