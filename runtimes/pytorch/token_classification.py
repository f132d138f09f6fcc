"""Named entities (NER, PII) with PyTorch: AutoModelForTokenClassification's label
probabilities per token; the entities are `runtimes.families.entities`'."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForTokenClassification

from runtimes.families.entities import EntityAdapter
from runtimes.model_files.precision import torch_dtype
from runtimes.pytorch import buckets
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.text import padded_chunks


class TokenClassificationAdapter(EntityAdapter):
    def load(self, ref: str) -> None:
        self.tokenizer, self.model, self.pad_id = load_model(
            AutoModelForTokenClassification, ref, self.device, torch_dtype(self.precision),
            self.chunk_tokens)
        self.config = self.model.config

    @torch.inference_mode()
    def probabilities(self, input_ids: list[list[int]],
                      token_type_ids: list[list[int]] | None) -> list[np.ndarray]:
        out: list[np.ndarray] = [np.empty(0)] * len(input_ids)
        lengths = [len(ids) for ids in input_ids]
        for chunk, inputs in padded_chunks(input_ids, token_type_ids, self.pad_id, self.device,
                                           self.chunk_tokens):
            logits = buckets.forward(self.model, inputs, "logits")
            probs = logits.float().softmax(dim=-1).cpu().numpy()
            for row, i in enumerate(chunk):
                out[i] = probs[row, : lengths[i]]
        return out
