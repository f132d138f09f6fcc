"""Query-document relevance scores from a cross-encoder (reranker).

A cross-encoder reads the query and one document together as a text pair and
gives a relevance logit, so it is a sequence classifier over pairs. Pairs are
tokenized and truncated the way `sentence_transformers.CrossEncoder` does it
(longest side first), so the scores match CrossEncoder.predict on the same
weights. The caller's `top_n` is applied by whoever ranks the results; here
every item gets its score, in input order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtimes.pytorch.sequence_classification import ClassifierAdapter, Tokens
from tasks.catalog import ModelEntry
from tasks.errors import ErrorCode, ShoalError
from tasks.schema import ParsedRequest, invalid


@dataclass(frozen=True, slots=True)
class _Prepared:
    activation: str | None
    tokens: Tokens  # one (query, item) pair per item


class CrossEncoderAdapter(ClassifierAdapter):
    """Catalog `adapter: cross-encoder`: one score per (query, item) pair."""

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.num_labels = self.classifier.num_labels

    def check(self, parsed: ParsedRequest) -> _Prepared:
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
        return _Prepared(activation, tokens)

    def _scores(self, logits: torch.Tensor, activation: str | None) -> torch.Tensor:
        """One score per row of (pairs, labels) logits; with several labels the last one
        (the 'relevant' class of a two-way reranker) is the score."""
        if activation is None:
            activation = "sigmoid" if self.num_labels == 1 else "softmax"
        if activation == "softmax":
            return logits.softmax(dim=-1)[:, -1]
        if activation == "sigmoid":
            return logits[:, -1].sigmoid()
        return logits[:, -1]

    def run(self, prepared: list[_Prepared]) -> list[dict[str, Any]]:
        logits = self.classifier.logits(Tokens.join([p.tokens for p in prepared]))
        results, offset = [], 0
        for p in prepared:
            n = len(p.tokens)
            scores = self._scores(logits[offset : offset + n], p.activation)
            results.append({"scores": scores.tolist(), "usage": {"tokens": p.tokens.count}})
            offset += n
        return results
