"""Named entities (NER, PII) on ONNX Runtime: the graph's logits per token, made label
probabilities here; the entities are `runtimes.families.entities`'."""

from __future__ import annotations

import numpy as np

from runtimes.families.classifiers import softmax
from runtimes.families.entities import EntityAdapter
from runtimes.onnx.adapter import OnnxAdapter


class OnnxTokenClassificationAdapter(OnnxAdapter, EntityAdapter):
    family = "token-classification"

    def load(self, ref: str) -> None:
        self.model = self.open_model(ref)
        self.tokenizer = self.model.tokenizer
        self.config = self.model.config

    def probabilities(self, input_ids: list[list[int]],
                      token_type_ids: list[list[int]] | None) -> list[np.ndarray]:
        out: list[np.ndarray] = [np.empty(0)] * len(input_ids)
        for chunk, inputs in self.model.chunks(input_ids, token_type_ids, self.chunk_tokens):
            probs = softmax(self.model.run(inputs).astype(np.float32))
            for row, i in enumerate(chunk):
                out[i] = probs[row, : len(input_ids[i])]
        return out
