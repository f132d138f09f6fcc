"""Query-document relevance scores from a cross-encoder (reranker) on PyTorch: a sequence
classifier over (query, document) pairs (`runtimes.families.classifiers.CrossEncoderAdapter`)."""

from __future__ import annotations

from runtimes.families import classifiers
from runtimes.pytorch.sequence_classification import SequenceClassifier


class CrossEncoderAdapter(classifiers.CrossEncoderAdapter):
    classifier_class = SequenceClassifier
