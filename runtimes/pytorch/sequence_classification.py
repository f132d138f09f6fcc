"""Text classification with PyTorch: the logits of AutoModelForSequenceClassification.

The adapters (a model's own labels, zero-shot labels via NLI) are
`runtimes.families.classifiers`'; this module gives them torch's `Classifier`, which
computes the logits in chunks bounded by padded tokens, so one long text does
not pad a whole batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification

from runtimes.families import classifiers
from runtimes.families.classifiers import Tokens
from runtimes.model_files.precision import torch_dtype
from runtimes.pytorch import buckets
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.text import padded_chunks


class SequenceClassifier(classifiers.Classifier):
    """A sequence-classification model on torch."""

    def load(self, ref: str, precision: str, **options: Any) -> None:
        self.tokenizer, self.model, self.pad_id = load_model(
            AutoModelForSequenceClassification, ref, self.device, torch_dtype(precision),
            self.chunk_tokens)
        self.config = self.model.config

    @torch.inference_mode()
    def logits(self, tokens: Tokens) -> np.ndarray:
        out = np.empty((len(tokens), self.num_labels), dtype=np.float32)
        for chunk, inputs in padded_chunks(tokens.input_ids, tokens.token_type_ids,
                                           self.pad_id, self.device, self.chunk_tokens):
            out[chunk] = buckets.forward(self.model, inputs, "logits").float().cpu().numpy()
        return out


class SequenceClassificationAdapter(classifiers.SequenceClassificationAdapter):
    classifier_class = SequenceClassifier


class ZeroShotAdapter(classifiers.ZeroShotAdapter):
    classifier_class = SequenceClassifier
