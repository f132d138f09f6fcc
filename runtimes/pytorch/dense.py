"""Dense text embeddings: a transformer encoder, pooling, optional normalisation.

`DenseEncoder` matches `sentence_transformers.SentenceTransformer.encode` on
the same weights: same truncation, same pooling, same normalisation. Texts
are sorted by token length and run in chunks bounded by padded tokens, so one
long text does not pad a whole batch. `DenseAdapter` serves it: prompts,
Matryoshka dimensions, output dtypes and LoRA adapters (texts of different
LoRAs in one forward pass, `runtimes.pytorch.lora`), and token-id items beside texts
(`runtimes.families.token_ids`: no prompt, no tokenizer, the same vector as their text).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel

from runtimes.families.st_config import read_st_config
from runtimes.families.token_ids import (
    Input,
    encode_inputs,
    has_tokens,
    input_lengths,
    vocabulary,
    with_token_ids,
)
from runtimes.families.vectors import dense_results, normalize_rows
from runtimes.pytorch import buckets, device_double
from runtimes.pytorch.adapter import Adapter
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.lora import LoraSet
from runtimes.pytorch.text import (
    HostCopy,
    check_lengths,
    host_chunks,
    max_length,
    to_device,
)
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest, check_encode_output


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None


@dataclass(frozen=True)
class _Planned:
    """A batch between `DenseAdapter.plan` and `finish`."""

    prepared: list[ParsedRequest]
    tokens: Tokenized
    loras: list[str | None] | None
    chunks: list[tuple[list[int], dict[str, torch.Tensor]]]


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
        st = read_st_config(Path(model_ref))
        self.tokenizer, self.model, self.pad_id = load_model(
            AutoModel, model_ref, device, dtype, bucket_tokens=chunk_tokens,
            bucket_width=max_seq_length or st.max_seq_length)
        self.device = device
        self.pooling = pooling or st.pooling or "mean"
        self.normalize = st.normalize if normalize is None else normalize
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

    def _prepare(self, texts: list[Input]) -> list[Input]:
        # A tokens item's ids are the model's input as they are: never lowercased.
        if not self.do_lower_case:
            return texts
        return [t.lower() if type(t) is str else t for t in texts]

    def tokenize(self, texts: list[Input]) -> Tokenized:
        """The model's inputs for texts and tokens items' ids (`runtimes.families.token_ids`)."""
        return Tokenized(*encode_inputs(self.tokenizer, self._prepare(texts),
                                        self.max_seq_length, self.vocab))

    def untruncated_lengths(self, texts: list[str]) -> list[int]:
        encoded = self.tokenizer(self._prepare(texts), truncation=False, padding=False)
        return [len(ids) for ids in encoded["input_ids"]]

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
        # On an emulated device (benchmarks) the passes queue as a GPU's kernels do, and
        # the HostCopy waits for them.
        double = device_double.current()
        with nullcontext() if double is None else double.queued():
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


class DenseAdapter(Adapter):
    """Catalog `adapter: dense`: the entry's prompts go before each text."""

    encoder_class: type[DenseEncoder] = DenseEncoder
    supports_lora = True

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.encoder = self.encoder_class(
            ref, device=self.device, pooling=entry.pooling,
            normalize=entry.normalize, max_seq_length=entry.max_seq_length,
            chunk_tokens=self.chunk_tokens, dtype=self.dtype,
        )
        self.dims = self.encoder.dims
        self.loras = self.encoder.loras
        self.loras.model_id = entry.id

    def check(self, parsed: ParsedRequest) -> ParsedRequest:
        if self.dims != self.entry.dims:  # else the entry's parse checked it all already
            check_encode_output(parsed.options, self.entry.id, "dense", self.dims)
        tokens = has_tokens(parsed.items)
        if tokens:
            self.encoder.vocab.check(parsed.items, self.entry.id)
        if not parsed.options.truncate:
            lengths = self.encoder.untruncated_lengths(self.prompted(parsed))
            check_lengths(input_lengths(lengths, parsed.items) if tokens else lengths,
                          self.encoder.max_seq_length)
        return parsed

    def run(self, prepared: list[ParsedRequest]) -> list[dict[str, Any]]:
        planned = self.plan(prepared)
        return self.finish(planned, self.forward(planned))

    def plan(self, prepared: list[ParsedRequest]) -> _Planned:
        texts = [t for parsed in prepared
                 for t in with_token_ids(self.prompted(parsed), parsed.items)]
        loras = [parsed.options.lora for parsed in prepared for _ in parsed.items]
        tokens = self.encoder.tokenize(texts)
        return _Planned(prepared, tokens, loras if any(loras) else None,
                        self.encoder.chunks(tokens))

    def forward(self, planned: _Planned) -> HostCopy:
        return self.encoder.forward(planned.chunks, planned.loras)

    def finish(self, planned: _Planned, output: HostCopy) -> list[dict[str, Any]]:
        tokens = planned.tokens
        vectors = self.encoder.gather(planned.chunks, output, len(tokens.input_ids))
        return dense_results(planned.prepared, vectors, tokens.input_ids,
                             self.encoder.normalize)
