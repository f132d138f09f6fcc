"""Text classification: labels from the model's own head, or caller-given labels via NLI.

`SequenceClassifier` is what every adapter over AutoModelForSequenceClassification
shares (this module's two and the cross-encoder): tokenizing texts or text
pairs within the model's limit and computing the logits in chunks bounded by
padded tokens, so one long text does not pad a whole batch.

`SequenceClassificationAdapter` gives the same scores as transformers'
text-classification pipeline on the same weights; `ZeroShotAdapter` the same
as its zero-shot-classification pipeline, which asks an NLI model whether each
text entails "This example is {label}." for every candidate label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from runtimes.pytorch.adapter import Adapter
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.text import check_lengths, max_length, padded_chunks
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode, ShoalError
from tasks.schema import DEFAULT_HYPOTHESIS, ClassifyOptions, ParsedRequest, invalid


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


class SequenceClassifier:
    """A sequence-classification model and its tokenizer: logits for texts or text pairs."""

    def __init__(self, ref: str, *, device: str, max_seq_length: int | None,
                 chunk_tokens: int, dtype: torch.dtype | None = None) -> None:
        self.tokenizer, self.model, self.pad_id = load_model(
            AutoModelForSequenceClassification, ref, device, dtype)
        self.config = self.model.config
        self.device = device
        self.chunk_tokens = chunk_tokens
        self.max_length = max_length(self.tokenizer, self.config, max_seq_length)
        self.num_labels = int(self.config.num_labels)
        self.labels = [str(self.config.id2label[i]) for i in range(self.num_labels)]

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

    @torch.inference_mode()
    def logits(self, tokens: Tokens) -> torch.Tensor:
        """(len(tokens), num_labels) float32 logits on the CPU, in input order."""
        out = torch.empty((len(tokens), self.num_labels), dtype=torch.float32)
        for chunk, inputs in padded_chunks(tokens.input_ids, tokens.token_type_ids,
                                           self.pad_id, self.device, self.chunk_tokens):
            out[chunk] = self.model(**inputs).logits.float().cpu()
        return out


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
    """An adapter over a sequence-classification head (also the cross-encoder's)."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.classifier = SequenceClassifier(ref, device=self.device,
                                             max_seq_length=entry.max_seq_length,
                                             chunk_tokens=self.chunk_tokens,
                                             dtype=self.dtype)


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

    def _scores(self, logits: torch.Tensor, multi_label: bool) -> torch.Tensor:
        # The text-classification pipeline's defaults, with the caller's multi_label on top.
        if multi_label:
            return logits.sigmoid()
        if self.problem_type == "regression":
            return logits
        if self.problem_type == "multi_label_classification" or len(self.labels) == 1:
            return logits.sigmoid()
        return logits.softmax(dim=-1)

    def run(self, prepared: list[_Prepared]) -> list[dict[str, Any]]:
        logits = self.classifier.logits(Tokens.join([p.tokens for p in prepared]))
        results, offset = [], 0
        for p in prepared:
            n = len(p.tokens)
            scores = self._scores(logits[offset : offset + n], p.options.multi_label)
            results.append({
                "labels": [ranked(self.labels, row, p.options.top_k) for row in scores.tolist()],
                "usage": {"tokens": p.tokens.count},
            })
            offset += n
        return results


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

    def _scores(self, logits: torch.Tensor, multi_label: bool) -> torch.Tensor:
        """(texts, labels) scores from (texts, labels, classes) logits."""
        if multi_label or logits.shape[1] == 1:
            # Each label on its own: entailment against contradiction.
            pair = logits[..., [self.contradiction, self.entailment]]
            return pair.softmax(dim=-1)[..., 1]
        return logits[..., self.entailment].softmax(dim=-1)

    def run(self, prepared: list[_Prepared]) -> list[dict[str, Any]]:
        logits = self.classifier.logits(Tokens.join([p.tokens for p in prepared]))
        results, offset = [], 0
        for p in prepared:
            n = len(p.tokens)
            per_text = logits[offset : offset + n].reshape(n // len(p.labels), len(p.labels), -1)
            scores = self._scores(per_text, p.options.multi_label)
            results.append({
                "labels": [ranked(p.labels, row, p.options.top_k) for row in scores.tolist()],
                "usage": {"tokens": p.tokens.count},
            })
            offset += n
        return results
