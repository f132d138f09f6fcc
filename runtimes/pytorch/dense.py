"""Dense text embeddings: a transformer encoder, pooling, optional normalisation.

Matches `sentence_transformers.SentenceTransformer.encode` on the same
weights: same truncation, same pooling, same normalisation. Texts are
sorted by token length and run in chunks bounded by padded tokens, so one
long text does not pad a whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from runtimes.pytorch.st_config import read_st_config


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None


class DenseEncoder:
    """A text encoder producing one float32 vector per text."""

    def __init__(
        self,
        model_ref: str,
        *,
        local: bool = True,
        device: str = "cpu",
        pooling: str | None = None,
        normalize: bool | None = None,
        max_seq_length: int | None = None,
        chunk_tokens: int = 16_384,
    ) -> None:
        st = read_st_config(Path(model_ref)) if local else read_st_config(Path("/nonexistent"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_ref, local_files_only=local)
        self.model = AutoModel.from_pretrained(model_ref, local_files_only=local)
        self.model.eval().to(device)
        self.device = device
        self.pooling = pooling or st.pooling or "mean"
        self.normalize = st.normalize if normalize is None else normalize
        self.do_lower_case = st.do_lower_case
        # The catalog wins, then the sentence-transformers files, then the
        # tokenizer's own limit (huge sentinel values mean "none").
        tokenizer_limit = self.tokenizer.model_max_length
        wanted = max_seq_length or st.max_seq_length or (
            tokenizer_limit if tokenizer_limit < 1_000_000 else None
        )
        limits = [
            n for n in (wanted, getattr(self.model.config, "max_position_embeddings", None)) if n
        ]
        self.max_seq_length = min(limits) if limits else 512
        self.dims = int(self.model.config.hidden_size)
        self.chunk_tokens = chunk_tokens
        self.pad_id = self.tokenizer.pad_token_id or 0

    def _prepare(self, texts: list[str]) -> list[str]:
        return [t.lower() for t in texts] if self.do_lower_case else texts

    def tokenize(self, texts: list[str]) -> Tokenized:
        encoded = self.tokenizer(
            self._prepare(texts),
            truncation=True,
            max_length=self.max_seq_length,
            padding=False,
        )
        return Tokenized(encoded["input_ids"], encoded.get("token_type_ids"))

    def untruncated_lengths(self, texts: list[str]) -> list[int]:
        encoded = self.tokenizer(self._prepare(texts), truncation=False, padding=False)
        return [len(ids) for ids in encoded["input_ids"]]

    def _chunks(self, lengths: list[int]) -> list[list[int]]:
        """Indices sorted by length, cut so each chunk's padded size fits the budget."""
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        chunks: list[list[int]] = []
        current: list[int] = []
        for i in order:
            # Sorted ascending, so the newcomer is the chunk's longest.
            if current and (len(current) + 1) * lengths[i] > self.chunk_tokens:
                chunks.append(current)
                current = []
            current.append(i)
        if current:
            chunks.append(current)
        return chunks

    def _pad(self, rows: list[list[int]], value: int) -> torch.Tensor:
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), value, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "lasttoken":
            last = mask.sum(dim=1) - 1
            return hidden[torch.arange(hidden.shape[0]), last]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)

    @torch.inference_mode()
    def embed(self, tokens: Tokenized) -> np.ndarray:
        """Pooled (not yet normalised) float32 vectors, in input order."""
        n = len(tokens.input_ids)
        out = np.empty((n, self.dims), dtype=np.float32)
        lengths = [len(ids) for ids in tokens.input_ids]
        for chunk in self._chunks(lengths):
            ids = self._pad([tokens.input_ids[i] for i in chunk], self.pad_id)
            mask = self._pad([[1] * lengths[i] for i in chunk], 0)
            inputs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
            if tokens.token_type_ids is not None:
                types = self._pad([tokens.token_type_ids[i] for i in chunk], 0)
                inputs["token_type_ids"] = types.to(self.device)
            hidden = self.model(**inputs).last_hidden_state
            pooled = self._pool(hidden, inputs["attention_mask"]).float().cpu().numpy()
            out[chunk] = pooled
        return out

    def encode(self, texts: list[str], *, normalize: bool | None = None) -> np.ndarray:
        vectors = self.embed(self.tokenize(texts))
        if self.normalize if normalize is None else normalize:
            vectors = normalize_rows(vectors)
        return vectors


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)
