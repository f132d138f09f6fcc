"""SPLADE sparse embeddings: a masked-LM's logits pooled into one weight per vocabulary term.

A term's weight is the max over the text's real tokens of log(1 + relu(logit)),
which is what sentence-transformers' `SparseEncoder` (MLM transformer +
`SpladePooling(max, relu)`) computes on the same weights. A sentence-transformers
save may ask for sum pooling or the `log1p_relu` activation instead; both are
read from its files. Results keep only the non-zero terms, so a vector costs
what the text says, not the vocabulary's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForMaskedLM

from runtimes.families.splade import (
    LOGITS_BUDGET,
    check_sparse_request,
    check_vocabulary,
    read_splade_config,
    sparse_results,
)
from runtimes.families.st_config import read_st_config
from runtimes.model_files.files import encoder_ref
from runtimes.pytorch import buckets
from runtimes.pytorch.adapter import Adapter
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.text import max_length, padded_chunks
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest


class SparseAdapter(Adapter):
    """Catalog `adapter: sparse`: SPLADE vectors over the model's vocabulary."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.splade = read_splade_config(ref)
        model_ref = encoder_ref(ref, self.splade.encoder_dir)
        st = read_st_config(Path(model_ref))
        self.tokenizer, self.model, self.pad_id = load_model(
            AutoModelForMaskedLM, model_ref, self.device, self.dtype,
            bucket_tokens=lambda config: self._forward_tokens(int(config.vocab_size)),
            bucket_width=entry.max_seq_length or st.max_seq_length)
        self.do_lower_case = st.do_lower_case
        self.max_seq_length = max_length(self.tokenizer, self.model.config, entry.max_seq_length,
                                         st.max_seq_length)
        self.vocab_size = int(self.model.config.vocab_size)
        check_vocabulary(entry, self.vocab_size)
        self.forward_tokens = self._forward_tokens(self.vocab_size)

    def _forward_tokens(self, vocab_size: int) -> int:
        """Padded tokens per pass: the logits (tokens x vocabulary) stay in LOGITS_BUDGET."""
        return max(1, min(self.chunk_tokens, LOGITS_BUDGET // vocab_size))

    def _texts(self, parsed: ParsedRequest) -> list[str]:
        return self.prompted(parsed, self.do_lower_case)

    def check(self, parsed: ParsedRequest) -> ParsedRequest:
        check_sparse_request(parsed, self.entry, self.tokenizer, self._texts(parsed),
                             self.max_seq_length)
        return parsed

    def _pool(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = logits.float().relu_().log1p_()
        if self.splade.activation == "log1p_relu":
            weights = weights.log1p_()
        # Weights are >= 0, so zeroing the padding keeps it out of a max as well as a sum.
        weights.mul_(mask.unsqueeze(-1).to(weights.dtype))
        return weights.amax(dim=1) if self.splade.pooling == "max" else weights.sum(dim=1)

    @torch.inference_mode()
    def embed(self, input_ids: list[list[int]],
              token_type_ids: list[list[int]] | None) -> list[dict[str, list]]:
        """One `{"indices", "values"}` per text (its non-zero terms, ascending), in order."""
        out: list[dict[str, list]] = [{}] * len(input_ids)
        for chunk, inputs in padded_chunks(input_ids, token_type_ids, self.pad_id, self.device,
                                           self.forward_tokens):
            logits = buckets.forward(self.model, inputs, "logits")
            pooled = self._pool(logits, inputs["attention_mask"]).cpu()
            for row, i in zip(pooled, chunk, strict=True):
                indices = row.nonzero().squeeze(1)
                out[i] = {"indices": indices.tolist(), "values": row[indices].tolist()}
        return out

    def run(self, prepared: list[ParsedRequest]) -> list[dict[str, Any]]:
        texts = [t for parsed in prepared for t in self._texts(parsed)]
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_seq_length,
                                 padding=False)
        input_ids = encoded["input_ids"]
        vectors = self.embed(input_ids, encoded.get("token_type_ids"))
        return sparse_results(prepared, vectors, input_ids, self.vocab_size)
