"""Named entities (NER, PII) from a token-classification model, with character offsets.

The model tags every token; the tags are turned into entities with the same
rules, and so the same results, as transformers' token-classification pipeline
for each of its aggregation strategies: "none" keeps one entry per tagged token,
"simple" joins adjacent tokens of one entity type, and "first", "average" and
"max" first give each word one tag from its sub-words (a word is what the
pipeline takes for one) and then join words. Unlike the pipeline, an entity's
text is the caller's text between its offsets, not the decoded tokens, so
`text == original[start:end]` always holds.

A runtime's adapter loads the model and computes each token's label
probabilities (`load`, `probabilities`): `runtimes.pytorch.token_classification`
with torch, `runtimes.onnx.tokens` with ONNX Runtime.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtimes.child_side.adapter import Adapter
from runtimes.families.text import check_lengths, max_length
from tasks.catalog import ModelEntry
from tasks.options import ExtractOptions
from tasks.schema import ParsedRequest

OUTSIDE = "O"  # the tag of tokens outside any entity, dropped from results
WORD_STRATEGIES = ("first", "average", "max")


@dataclass(frozen=True, slots=True)
class _Prepared:
    options: ExtractOptions
    texts: list[str]
    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None
    offsets: list[list[tuple[int, int]]]
    special: list[list[int]]  # 1 for special tokens ([CLS], [SEP], ...)


@dataclass(frozen=True, slots=True)
class _Token:
    """One non-special token: its span in the text and its label probabilities."""

    start: int
    end: int
    probs: np.ndarray
    continues_word: bool  # a sub-word of the word the previous token began


@dataclass(frozen=True, slots=True)
class _Tagged:
    """A token or a word with its one tag, before adjacent ones are joined."""

    label: str
    score: float
    start: int
    end: int


def _bio(label: str) -> tuple[str, str]:
    """(B or I, entity type); a tag without a B-/I- prefix continues like I-."""
    if label.startswith("B-"):
        return "B", label[2:]
    if label.startswith("I-"):
        return "I", label[2:]
    return "I", label


def _join(tagged: Sequence[_Tagged]) -> list[_Tagged]:
    """Adjacent tags of one type joined (a B- starts a new entity); score is their mean."""
    groups: list[list[_Tagged]] = []
    for tag in tagged:
        if groups:
            bi, kind = _bio(tag.label)
            if bi != "B" and kind == _bio(groups[-1][-1].label)[1]:
                groups[-1].append(tag)
                continue
        groups.append([tag])
    return [
        _Tagged(group[0].label.split("-", 1)[-1], float(np.mean([t.score for t in group])),
                group[0].start, group[-1].end)
        for group in groups
    ]


class EntityAdapter(Adapter):
    """Catalog `adapter: token-classification`: entities per item."""

    tokenizer: Any  # called as transformers' fast tokenizers are
    config: Any  # num_labels, id2label, max_position_embeddings

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.load(ref)
        if not self.tokenizer.is_fast:
            raise ValueError(f"{entry.id}: token classification needs a fast tokenizer (a "
                             "tokenizer.json) to map tokens back to character offsets")
        config = self.config
        self.labels = [str(config.id2label[i]) for i in range(int(config.num_labels))]
        self.max_length = max_length(self.tokenizer, config, entry.max_seq_length)
        self.unk_id = self.tokenizer.unk_token_id
        # WordPiece-like tokenizers mark sub-words ("##ing"); for the others a token
        # continues a word when no space separates it from the previous character.
        backend = self.tokenizer.backend_tokenizer.model
        self.marks_subwords = bool(getattr(backend, "continuing_subword_prefix", None))

    def check(self, parsed: ParsedRequest) -> _Prepared:
        texts = parsed.texts
        if not parsed.options.truncate:
            untruncated = self.tokenizer(texts, truncation=False, padding=False)["input_ids"]
            check_lengths([len(ids) for ids in untruncated], self.max_length)
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length,
                                 padding=False, return_offsets_mapping=True,
                                 return_special_tokens_mask=True)
        return _Prepared(parsed.options, texts, encoded["input_ids"],
                         encoded.get("token_type_ids"), encoded["offset_mapping"],
                         encoded["special_tokens_mask"])

    @abstractmethod
    def load(self, ref: str) -> None:
        """Set `tokenizer` and `config` (and the model) from the directory `ref`."""

    @abstractmethod
    def probabilities(self, input_ids: list[list[int]],
                      token_type_ids: list[list[int]] | None) -> list[np.ndarray]:
        """Per sequence, a (tokens, labels) float32 array of label probabilities."""

    def _tokens(self, text: str, ids: list[int], offsets: list[tuple[int, int]],
                special: list[int], probs: np.ndarray, words: bool) -> list[_Token]:
        pieces = self.tokenizer.convert_ids_to_tokens(ids) if words else None
        tokens = []
        for k, (token_id, (start, end)) in enumerate(zip(ids, offsets, strict=True)):
            if special[k]:
                continue
            continues = False
            if pieces is not None and token_id != self.unk_id:
                if self.marks_subwords:
                    # "##ing" over "ing": the prefix makes them differ.
                    continues = len(pieces[k]) != end - start
                else:
                    continues = start > 0 and " " not in text[start - 1 : start + 1]
            tokens.append(_Token(start, end, probs[k], continues))
        return tokens

    def _word(self, tokens: Sequence[_Token], strategy: str) -> _Tagged:
        """One tag for a word from its tokens' probabilities (a lone token: its own)."""
        if strategy == "first":
            probs = tokens[0].probs
        elif strategy == "max":
            probs = max(tokens, key=lambda t: t.probs.max()).probs
        else:
            probs = np.nanmean(np.stack([t.probs for t in tokens]), axis=0)
        best = int(probs.argmax())
        return _Tagged(self.labels[best], float(probs[best]), tokens[0].start, tokens[-1].end)

    def _tagged(self, tokens: list[_Token], strategy: str) -> list[_Tagged]:
        if strategy not in WORD_STRATEGIES:
            return [self._word([token], "first") for token in tokens]
        words: list[list[_Token]] = []
        for token in tokens:
            if words and token.continues_word:
                words[-1].append(token)
            else:
                words.append([token])
        return [self._word(word, strategy) for word in words]

    def _entities(self, text: str, tokens: list[_Token],
                  options: ExtractOptions) -> list[dict[str, Any]]:
        tagged = self._tagged(tokens, options.aggregation)
        if options.aggregation != "none":
            tagged = _join(tagged)
        return [
            {"label": t.label, "text": text[t.start : t.end], "start": int(t.start),
             "end": int(t.end), "score": t.score}
            for t in tagged
            if t.label != OUTSIDE and t.score >= options.threshold
        ]

    def run(self, prepared: list[_Prepared]) -> list[dict[str, Any]]:
        input_ids = [ids for p in prepared for ids in p.input_ids]
        if any(p.token_type_ids is None for p in prepared):
            token_type_ids = None
        else:
            token_type_ids = [row for p in prepared for row in p.token_type_ids or ()]
        probs = self.probabilities(input_ids, token_type_ids)
        results, offset = [], 0
        for p in prepared:
            words = p.options.aggregation in WORD_STRATEGIES
            entities = []
            for j, text in enumerate(p.texts):
                tokens = self._tokens(text, p.input_ids[j], p.offsets[j], p.special[j],
                                      probs[offset + j], words)
                entities.append(self._entities(text, tokens, p.options))
            results.append({"entities": entities,
                            "usage": {"tokens": sum(len(ids) for ids in p.input_ids)}})
            offset += len(p.texts)
        return results
