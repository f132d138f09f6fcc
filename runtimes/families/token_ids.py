"""Token-id items (`{"tokens": [...]}`, `tasks.schema`) on the runtime side, without torch.

A tokens item carries the model's input ids exactly as its own tokenizer gives them for a
text, special tokens included: `tokenizer(text)["input_ids"]` (what TEI and vLLM take as
token ids). It skips the tokenizer, the entry's prompts and lowercasing, so a text and its
ids give the same vector. Three checks make that hold and keep the model safe:

- every id must be one of the model's (`Vocabulary.size`: the tokenizer's ids, never more
  than the embedding matrix has rows); an id past it fails its request with a
  VALIDATION_ERROR that names the item, not the batch (an index past the embedding matrix
  would fail the whole forward pass, or worse on a GPU);
- where the tokenizer puts special ids around every text (BERT's [CLS] ... [SEP], an EOS
  after it), the ids must have them: ids without them are another tokenizer's (LangChain's
  OpenAIEmbeddings sends OpenAI's tiktoken ids by default, which mostly fall inside a BERT
  vocabulary and would embed as nonsense, silently) or were made without special tokens,
  and either way would not give the text's vector;
- a sequence over the model's limit is cut as the tokenizer cuts the text it came from
  (`Vocabulary.fit`): the special tokens the tokenizer puts around a text (BERT's [CLS]
  and [SEP], an EOS) are kept and the ids between them shortened, on the tokenizer's
  truncation side. With options.truncate false it is INPUT_TOO_LONG, as a text is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtimes.families.text import encode_texts
from tasks.schema import Item, invalid

# A text every tokenizer turns into at least one id of its own, to see what it adds around it.
_PROBE = "a"


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What a model's tokenizer says about the ids it takes."""

    size: int  # ids 0 to size - 1 are the model's
    prefix: tuple[int, ...]  # the special ids the tokenizer puts before a text ([CLS], BOS)
    suffix: tuple[int, ...]  # ... and after it ([SEP], EOS)
    left: bool = False  # the tokenizer truncates on the left
    frame: str = ""  # the special ids around a text, in words: "start with [CLS] (101) ..."

    def check(self, items: Sequence[Item], model: str) -> None:
        """VALIDATION_ERROR for the first tokens item with an id that is not the model's, or
        without the special ids the model's tokenizer puts around every text."""
        for i, item in enumerate(items):
            ids = item.tokens
            if ids is None:
                continue
            check_ids(ids, i, self.size, model)
            if not self.framed(ids):
                raise invalid(
                    f"items[{i}] does not {self.frame}, as {model}'s tokenizer puts them "
                    "around every text: send the ids of this model's own tokenizer with its "
                    "special tokens (tokenizer(text)['input_ids']), or send text. (LangChain's "
                    "OpenAIEmbeddings sends OpenAI's tiktoken ids unless "
                    "check_embedding_ctx_length=False.)")

    def framed(self, ids: Sequence[int]) -> bool:
        """Whether `ids` start with the prefix and end with the suffix (and hold both)."""
        head, tail = len(self.prefix), len(self.suffix)
        return len(ids) >= head + tail and tuple(ids[:head]) == self.prefix and \
            tuple(ids[len(ids) - tail:]) == self.suffix

    def fit(self, ids: Sequence[int], limit: int) -> list[int]:
        """`ids` cut to `limit` as the tokenizer would cut the text they came from: the
        special ids around it kept, the ids between them shortened on the tokenizer's side."""
        if len(ids) <= limit:
            return list(ids)
        head = len(self.prefix) if tuple(ids[:len(self.prefix)]) == self.prefix else 0
        tail = len(self.suffix) if self.suffix and \
            tuple(ids[len(ids) - len(self.suffix):]) == self.suffix else 0
        room = limit - head - tail
        if room <= 0:  # a limit too short to hold the special ids: cut plainly
            return list(ids[:limit])
        body = ids[head:len(ids) - tail]
        body = body[len(body) - room:] if self.left else body[:room]
        return [*ids[:head], *body, *ids[len(ids) - tail:]]


def check_ids(ids: Sequence[int], index: int, size: int, model: str) -> None:
    """VALIDATION_ERROR naming item `index` if one of `ids` is not below `size`."""
    if max(ids) >= size:
        bad = next(t for t in ids if t >= size)
        raise invalid(f"items[{index}] has token id {bad}, but {model}'s vocabulary has "
                      f"{size} ids (0-{size - 1}): send ids from this model's own tokenizer, "
                      "or send text")


def vocabulary(tokenizer: Any, rows: int | None = None) -> Vocabulary:
    """The Vocabulary of a transformers tokenizer (fast or slow) or of the ONNX runtime's
    `FileTokenizer`; `rows`: the model's embedding rows, where known (a model may have
    more rows than its tokenizer has ids, padded for speed: those rows mean nothing)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer

        size = backend.get_vocab_size(with_added_tokens=True)
        # A copy: the shared backend's padding and truncation are whatever its last user
        # set (a tokenizer.json may even ship padding on).
        backend = Tokenizer.from_str(backend.to_str())
        backend.no_padding()
        backend.no_truncation()
        with_special = backend.encode(_PROBE).ids
        plain = backend.encode(_PROBE, add_special_tokens=False).ids
    else:
        size = len(tokenizer)
        with_special = tokenizer(_PROBE)["input_ids"]
        plain = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    if rows:
        size = min(size, rows)
    prefix, suffix = _around(list(with_special), list(plain))
    name = backend.id_to_token if backend is not None else tokenizer.convert_ids_to_tokens
    return Vocabulary(size, prefix, suffix,
                      getattr(tokenizer, "truncation_side", "right") == "left",
                      _frame(prefix, suffix, name))


def _frame(prefix: tuple[int, ...], suffix: tuple[int, ...], name: Any) -> str:
    def shown(ids: tuple[int, ...]) -> str:
        return " ".join(f"{name(i)} ({i})" for i in ids)

    parts = ([f"start with {shown(prefix)}"] if prefix else []) + \
        ([f"end with {shown(suffix)}"] if suffix else [])
    return " and ".join(parts)


def _around(with_special: list[int], plain: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids before and after `plain` in `with_special` (none if it is not in there)."""
    n = len(plain)
    for start in range(len(with_special) - n + 1):
        if with_special[start:start + n] == plain:
            return tuple(with_special[:start]), tuple(with_special[start + n:])
    return (), ()


# One input of a dense batch: a text (prompted, lowercased where the model wants it) or the
# ids of a tokens item, which get neither.
Input = str | tuple[int, ...]


def has_tokens(items: Sequence[Item]) -> bool:
    # A loop, not any() over a generator: called twice per request, and a batch of many
    # one-item requests paid the generator's set-up for each.
    for item in items:  # noqa: SIM110
        if item.tokens is not None:
            return True
    return False


def with_token_ids(texts: list[Any], items: Sequence[Item]) -> list[Input]:
    """`texts` (one per item) with each tokens item's ids in its place (`texts` itself
    when there is none)."""
    if not has_tokens(items):
        return texts
    return [text if item.tokens is None else item.tokens
            for text, item in zip(texts, items, strict=True)]


def input_lengths(lengths: list[int], items: Sequence[Item]) -> list[int]:
    """Untruncated lengths of a request's texts (`lengths`, one per item) with each tokens
    item's own length in its place: what options.truncate false checks."""
    return [n if item.tokens is None else len(item.tokens)
            for n, item in zip(lengths, items, strict=True)]


def encode_inputs(tokenizer: Any, inputs: Sequence[Input], limit: int, vocab: Vocabulary
                  ) -> tuple[list[list[int]], list[list[int]] | None]:
    """Token ids (and token type ids, where the model takes them) of a batch's inputs, as
    `runtimes.families.text.encode_texts` gives them for texts: a tokens item's ids fitted to
    `limit` (`Vocabulary.fit`), its token types zeros (a single sequence's)."""
    if all(type(x) is str for x in inputs):  # no tokens item: the tokenizer's batch as it was
        return encode_texts(tokenizer, list(inputs), limit)
    texts = [x for x in inputs if type(x) is str]
    encoded, encoded_types = encode_texts(tokenizer, texts, limit) if texts else ([], None)
    types: list[list[int]] | None = \
        [] if "token_type_ids" in tokenizer.model_input_names else None
    ids: list[list[int]] = []
    k = 0
    for x in inputs:
        if type(x) is str:
            row = encoded[k]
            if types is not None:
                types.append(encoded_types[k] if encoded_types is not None else [0] * len(row))
            k += 1
        else:
            row = vocab.fit(x, limit)
            if types is not None:
                types.append([0] * len(row))
        ids.append(row)
    return ids, types
