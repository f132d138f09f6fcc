"""Sequence classifiers, whatever computes them: fixed labels, zero-shot and rerankers.

Every adapter over a sequence-classification head (a model's own labels, NLI
zero-shot labels, a cross-encoder's relevance) shares the tokenizing, the length
checks and the scoring here; a runtime supplies only the `Classifier` that turns
token ids into logits (`runtimes.pytorch.sequence_classification` with torch,
`runtimes.onnx.classify` with ONNX Runtime). Scores are numpy, so both give the
same results: transformers' text-classification and zero-shot-classification
pipelines' and `sentence_transformers.CrossEncoder.predict`'s on the same weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from runtimes.child_side.adapter import Adapter
from runtimes.families.text import check_lengths, max_length
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode, ShoalError
from tasks.options import DEFAULT_HYPOTHESIS, ClassifyOptions
from tasks.schema import ParsedRequest, invalid


@dataclass(frozen=True, slots=True)
class Tokens:
    """Token ids of several sequences (texts or pairs), unpadded."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def count(self) -> int:
        return sum(len(ids) for ids in self.input_ids)

    @staticmethod
    def join(parts: Sequence[Tokens]) -> Tokens:
        ids = [row for part in parts for row in part.input_ids]
        if any(part.token_type_ids is None for part in parts):
            return Tokens(ids, None)
        return Tokens(ids, [row for part in parts for row in part.token_type_ids or ()])


class Classifier(ABC):
    """A sequence-classification model and its tokenizer: logits for texts or text pairs.

    A runtime's subclass loads `tokenizer` (called as transformers' tokenizers are) and
    `config` (num_labels, id2label, label2id, problem_type, max_position_embeddings) and
    computes `logits`."""

    tokenizer: Any
    config: Any

    def __init__(self, ref: str, *, device: str, max_seq_length: int | None,
                 chunk_tokens: int, precision: str = "fp32", **options: Any) -> None:
        self.device = device
        self.chunk_tokens = chunk_tokens
        self.load(ref, precision, **options)
        self.max_length = max_length(self.tokenizer, self.config, max_seq_length)
        self.num_labels = int(self.config.num_labels)
        self.labels = [str(self.config.id2label[i]) for i in range(self.num_labels)]

    @abstractmethod
    def load(self, ref: str, precision: str, **options: Any) -> None:
        """Set `tokenizer` and `config` (and the model) from the directory `ref`."""

    @abstractmethod
    def logits(self, tokens: Tokens) -> np.ndarray:
        """(len(tokens), num_labels) float32 logits, in input order."""

    def tokenize(self, first: list[str], second: list[str] | None = None,
                 truncation: bool | str = True) -> Tokens:
        """Truncated to the model's limit; `truncation` picks which side of a pair gives way."""
        encoded = self.tokenizer(first, second, truncation=truncation,
                                 max_length=self.max_length, padding=False)
        return Tokens(encoded["input_ids"], encoded.get("token_type_ids"))

    def lengths(self, first: list[str], second: list[str] | None = None) -> list[int]:
        """Untruncated lengths in tokens, special tokens included."""
        encoded = self.tokenizer(first, second, truncation=False, padding=False)
        return [len(ids) for ids in encoded["input_ids"]]


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    # 1 / (1 + e^-x) without overflowing e^-x for very negative logits.
    return np.exp(-np.logaddexp(0, -logits))


def ranked(labels: Sequence[str], scores: Sequence[float],
           top_k: int | None) -> list[dict[str, Any]]:
    """`{"label", "score"}` by score, highest first (ties keep label order), cut to top_k."""
    order = sorted(range(len(labels)), key=lambda i: -scores[i])
    return [{"label": labels[i], "score": float(scores[i])} for i in order[:top_k]]


@dataclass(frozen=True, slots=True)
class _Prepared:
    options: ClassifyOptions
    tokens: Tokens
    # Zero-shot: the candidate labels; each text's pairs are consecutive, one per label.
    labels: tuple[str, ...] = ()


class ClassifierAdapter(Adapter):
    """An adapter over a sequence-classification head: the runtime's `classifier_class`
    computes the logits of a whole batch in `forward`, and `scored` turns each request's
    rows into its result."""

    classifier_class: ClassVar[type[Classifier]]

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.classifier = self.classifier_class(ref, device=self.device,
                                                max_seq_length=entry.max_seq_length,
                                                chunk_tokens=self.chunk_tokens,
                                                precision=self.precision,
                                                **self.classifier_options())

    def classifier_options(self) -> dict[str, Any]:
        """What else the runtime's classifier takes."""
        return {}

    def run(self, prepared: list[Any]) -> list[dict[str, Any]]:
        return self.finish(prepared, self.forward(prepared))

    def forward(self, planned: list[Any]) -> np.ndarray:
        return self.classifier.logits(Tokens.join([p.tokens for p in planned]))

    def finish(self, planned: list[Any], output: np.ndarray) -> list[dict[str, Any]]:
        results, offset = [], 0
        for p in planned:
            n = len(p.tokens)
            results.append({**self.scored(p, output[offset : offset + n]),
                            "usage": {"tokens": p.tokens.count}})
            offset += n
        return results

    @abstractmethod
    def scored(self, prepared: Any, logits: np.ndarray) -> dict[str, Any]:
        """One request's result (but its usage) from its rows of logits."""


class SequenceClassificationAdapter(ClassifierAdapter):
    """Catalog `adapter: sequence-classification`: the labels of the model's head."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.labels = self.classifier.labels
        self.problem_type = getattr(self.classifier.config, "problem_type", None)

    def check(self, parsed: ParsedRequest) -> _Prepared:
        options: ClassifyOptions = parsed.options
        if options.labels is not None or options.hypothesis_template is not None:
            raise invalid(f"{self.entry.id} has fixed labels {self.labels}; options.labels and "
                          "options.hypothesis_template are for zero-shot models")
        texts = parsed.texts
        if not options.truncate:
            check_lengths(self.classifier.lengths(texts), self.classifier.max_length)
        return _Prepared(options, self.classifier.tokenize(texts))

    def _scores(self, logits: np.ndarray, multi_label: bool) -> np.ndarray:
        # The text-classification pipeline's defaults, with the caller's multi_label on top.
        if multi_label:
            return sigmoid(logits)
        if self.problem_type == "regression":
            return logits
        if self.problem_type == "multi_label_classification" or len(self.labels) == 1:
            return sigmoid(logits)
        return softmax(logits)

    def scored(self, prepared: _Prepared, logits: np.ndarray) -> dict[str, Any]:
        scores = self._scores(logits, prepared.options.multi_label)
        top_k = prepared.options.top_k
        return {"labels": [ranked(self.labels, row, top_k) for row in scores.tolist()]}


def _label_id(label2id: dict[str, int], prefix: str) -> int | None:
    return next((int(i) for label, i in label2id.items()
                 if str(label).lower().startswith(prefix)), None)


class ZeroShotAdapter(ClassifierAdapter):
    """Catalog `adapter: zero-shot`: an NLI model scores caller-given labels."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        label2id = dict(self.classifier.config.label2id or {})
        entailment = _label_id(label2id, "entail")
        if entailment is None or self.classifier.num_labels < 2:
            raise ValueError(
                f"{entry.id} cannot serve zero-shot: it needs an NLI model whose config "
                f"label2id has an 'entailment' label, and it has {sorted(label2id)}"
            )
        self.entailment = entailment
        contradiction = _label_id(label2id, "contradict")
        if contradiction is None:
            # Two-way NLI ("entailment", "not_entailment"): the other class, as the
            # zero-shot pipeline picks it.
            contradiction = self.classifier.num_labels - 1 if entailment == 0 else 0
        self.contradiction = contradiction

    def probe(self) -> dict[str, Any]:
        # Zero-shot needs candidate labels, which a fixed-label model would refuse.
        return {**super().probe(), "options": {"labels": ["yes", "no"]}}

    def check(self, parsed: ParsedRequest) -> _Prepared:
        options: ClassifyOptions = parsed.options
        if options.labels is None:
            raise invalid("options.labels is missing: zero-shot classification needs the "
                          'candidate labels, e.g. {"labels": ["sports", "politics", "music"]}')
        template = options.hypothesis_template or DEFAULT_HYPOTHESIS
        hypotheses = [template.replace("{}", label, 1) for label in options.labels]
        limit = self.classifier.max_length
        # The text is truncated, never the hypothesis: each must leave room for a token of it.
        empty = [""] * len(hypotheses)
        for j, length in enumerate(self.classifier.lengths(empty, hypotheses)):
            if length >= limit:
                raise ShoalError(
                    ErrorCode.INPUT_TOO_LONG,
                    f"options.labels[{j}] in the hypothesis template takes {length} tokens, "
                    f"leaving no room for the text in the model's {limit}; shorten the label "
                    "or options.hypothesis_template",
                )
        texts = parsed.texts
        first = [text for text in texts for _ in hypotheses]
        second = hypotheses * len(texts)
        if not options.truncate:
            lengths = self.classifier.lengths(first, second)
            n = len(hypotheses)
            check_lengths([max(lengths[i * n : (i + 1) * n]) for i in range(len(texts))], limit)
        tokens = self.classifier.tokenize(first, second, truncation="only_first")
        return _Prepared(options, tokens, options.labels)

    def _scores(self, logits: np.ndarray, multi_label: bool) -> np.ndarray:
        """(texts, labels) scores from (texts, labels, classes) logits."""
        if multi_label or logits.shape[1] == 1:
            # Each label on its own: entailment against contradiction.
            pair = logits[..., [self.contradiction, self.entailment]]
            return softmax(pair)[..., 1]
        return softmax(logits[..., self.entailment])

    def scored(self, prepared: _Prepared, logits: np.ndarray) -> dict[str, Any]:
        labels = prepared.labels
        per_text = logits.reshape(len(logits) // len(labels), len(labels), -1)
        scores = self._scores(per_text, prepared.options.multi_label)
        top_k = prepared.options.top_k
        return {"labels": [ranked(labels, row, top_k) for row in scores.tolist()]}


@dataclass(frozen=True, slots=True)
class _Pairs:
    activation: str | None
    tokens: Tokens  # one (query, item) pair per item


class CrossEncoderAdapter(ClassifierAdapter):
    """Catalog `adapter: cross-encoder`: one score per (query, item) pair.

    A cross-encoder reads the query and one document together as a text pair and gives
    a relevance logit. Pairs are truncated longest side first, as CrossEncoder does it.
    The caller's `top_n` is applied by whoever ranks the results; here every item gets
    its score, in input order."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.num_labels = self.classifier.num_labels

    def check(self, parsed: ParsedRequest) -> _Pairs:
        activation = parsed.options.activation
        if activation == "softmax" and self.num_labels == 1:
            raise invalid(f"options.activation 'softmax' needs several labels, and {self.entry.id} "
                          "gives one logit; use 'sigmoid' or 'none'")
        texts = parsed.texts
        queries = [parsed.query or ""] * len(texts)
        if not parsed.options.truncate:
            limit = self.classifier.max_length
            for i, length in enumerate(self.classifier.lengths(queries, texts)):
                if length > limit:
                    raise ShoalError(
                        ErrorCode.INPUT_TOO_LONG,
                        f"items[{i}] with the query has {length} tokens, over the model's "
                        f"{limit}; shorten them or set options.truncate to true",
                    )
        tokens = self.classifier.tokenize(queries, texts, truncation="longest_first")
        return _Pairs(activation, tokens)

    def _scores(self, logits: np.ndarray, activation: str | None) -> np.ndarray:
        """One score per row of (pairs, labels) logits; with several labels the last one
        (the 'relevant' class of a two-way reranker) is the score."""
        if activation is None:
            activation = "sigmoid" if self.num_labels == 1 else "softmax"
        if activation == "softmax":
            return softmax(logits)[:, -1]
        if activation == "sigmoid":
            return sigmoid(logits[:, -1])
        return logits[:, -1]

    def scored(self, prepared: _Pairs, logits: np.ndarray) -> dict[str, Any]:
        return {"scores": self._scores(logits, prepared.activation).tolist()}
