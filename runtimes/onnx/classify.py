"""Sequence classifiers on ONNX Runtime: the graph's logits for the shared adapters of
`runtimes.families.classifiers` (a model's own labels, zero-shot labels, reranker scores)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from runtimes.families import classifiers
from runtimes.families.classifiers import Tokens
from runtimes.onnx.adapter import OnnxAdapter
from runtimes.onnx.session import OnnxModel


class OnnxClassifier(classifiers.Classifier):
    def load(self, ref: str, precision: str, **options: Any) -> None:
        self.model = OnnxModel(options["model_id"], Path(ref), "sequence-classification",
                               precision=precision, device=self.device,
                               threads=options["threads"], clock=options["clock"])
        self.tokenizer = self.model.tokenizer
        self.config = self.model.config

    def logits(self, tokens: Tokens) -> np.ndarray:
        out = np.empty((len(tokens), self.num_labels), dtype=np.float32)
        for chunk, inputs in self.model.chunks(tokens.input_ids, tokens.token_type_ids,
                                               self.chunk_tokens):
            out[chunk] = self.model.run(inputs)
        return out


class _OnnxClassifierAdapter(OnnxAdapter):
    family = "sequence-classification"
    classifier_class = OnnxClassifier

    @property
    def graph_bytes(self) -> int:
        return self.classifier.model.graph_bytes

    def classifier_options(self) -> dict[str, Any]:
        return {"model_id": self.entry.id, "threads": self.threads, "clock": self.clock}


class OnnxSequenceClassificationAdapter(_OnnxClassifierAdapter,
                                        classifiers.SequenceClassificationAdapter):
    pass


class OnnxZeroShotAdapter(_OnnxClassifierAdapter, classifiers.ZeroShotAdapter):
    pass


class OnnxCrossEncoderAdapter(_OnnxClassifierAdapter, classifiers.CrossEncoderAdapter):
    pass
