"""Text helpers every runtime's adapters use, without torch: length limits, the
attention mask, chunks of similar lengths."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

import numpy as np

from tasks.errors import ErrorCode, ShoalError

encoding_lock = threading.Lock()  # a fast tokenizer's truncation setting is shared state

# Tokenizers without a limit report a huge sentinel (int(1e30)).
_NO_LIMIT = 1_000_000


def max_length(tokenizer: Any, model_config: object,
               *wanted: int | None) -> int:
    """The sequence limit: the first of `wanted` given (catalog, model files), then the
    tokenizer's own, never over the model's position embeddings."""
    limit = next((n for n in wanted if n), None)
    if limit is None and tokenizer.model_max_length < _NO_LIMIT:
        limit = tokenizer.model_max_length
    positions = getattr(model_config, "max_position_embeddings", None)
    limits = [n for n in (limit, positions) if n]
    return min(limits) if limits else 512


def too_long(index: int, length: int, limit: int, what: str = "items") -> ShoalError:
    return ShoalError(
        ErrorCode.INPUT_TOO_LONG,
        f"{what}[{index}] has {length} tokens, over the model's {limit}; shorten it or set "
        "options.truncate to true",
    )


def check_lengths(lengths: Sequence[int], limit: int, what: str = "items") -> None:
    """INPUT_TOO_LONG for the first of `lengths` (untruncated, in tokens) over `limit`."""
    for i, length in enumerate(lengths):
        if length > limit:
            raise too_long(i, length, limit, what)


def filled(lengths: np.ndarray, left: bool = False, multiple: int = 1) -> np.ndarray:
    """The (rows, width) boolean mask of the places that rows of `lengths` fill when
    padded on the right (or left): the attention mask. The width is the longest row's,
    rounded up to a `multiple`."""
    width = -(-int(lengths.max(initial=0)) // multiple) * multiple
    places = np.arange(width)
    if left:
        return places >= (width - lengths)[:, None]
    return places < lengths[:, None]


def row_lengths(rows: Sequence[Sequence[int]]) -> np.ndarray:
    return np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))


def padded(rows: Sequence[Sequence[int]], lengths: np.ndarray, mask: np.ndarray,
           value: int) -> np.ndarray:
    """`rows` laid into `mask`'s places (row-major, their own order), `value` elsewhere:
    an int64 array of the mask's shape."""
    out = np.full(mask.shape, value, dtype=np.int64)
    out[mask] = np.fromiter(chain.from_iterable(rows), dtype=np.int64,
                            count=int(lengths.sum()))
    return out


def padded_inputs(input_ids: Sequence[Sequence[int]],
                  token_type_ids: Sequence[Sequence[int]] | None, pad_id: int,
                  multiple: int = 1) -> dict[str, np.ndarray]:
    """Right-padded int64 input_ids, attention_mask (and token_type_ids), as wide as the
    longest row rounded up to a `multiple`: an encoder's inputs."""
    # One mask for the three: token type rows are as long as their id rows.
    lengths = row_lengths(input_ids)
    mask = filled(lengths, multiple=multiple)
    inputs = {"input_ids": padded(input_ids, lengths, mask, pad_id),
              "attention_mask": mask.astype(np.int64)}
    if token_type_ids is not None:
        inputs["token_type_ids"] = padded(token_type_ids, lengths, mask, 0)
    return inputs


def chunked_inputs(input_ids: Sequence[Sequence[int]],
                   token_type_ids: Sequence[Sequence[int]] | None, pad_id: int, budget: int,
                   multiple: int = 1) -> Iterator[tuple[list[int], dict[str, np.ndarray]]]:
    """(indices, `padded_inputs`) per chunk of `length_chunks`: what every encoder loop runs."""
    for chunk in length_chunks([len(ids) for ids in input_ids], budget):
        types = None if token_type_ids is None else [token_type_ids[i] for i in chunk]
        yield chunk, padded_inputs([input_ids[i] for i in chunk], types, pad_id, multiple)


def length_chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices sorted by length, cut so each chunk's padded size (count x longest) fits
    `budget`; one long sequence then does not pad a whole batch."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so the newcomer is the chunk's longest.
        if current and (len(current) + 1) * lengths[i] > budget:
            chunks.append(current)
            current = []
        current.append(i)
    if current:
        chunks.append(current)
    return chunks


def encode_texts(tokenizer: Any, texts: list[str], limit: int
                 ) -> tuple[list[list[int]], list[list[int]] | None]:
    """Token ids (and token type ids, where the model takes them) of `texts`, special
    tokens added, truncated to `limit`: what `tokenizer(texts, truncation=True,
    max_length=limit)` gives, straight from a fast tokenizer's Rust encoder (its batch
    runs on several threads where TOKENIZERS_PARALLELISM allows) without transformers'
    conversion of every encoding to dicts of lists (a fifth of the runtime's CPU
    under load). Plain texts go through the tokenizer's `plain_text_twin` where it has
    one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
    types = "token_type_ids" in tokenizer.model_input_names
    if backend is None:
        encoded = tokenizer(texts, truncation=True, max_length=limit, padding=False)
        return encoded["input_ids"], encoded.get("token_type_ids") if types else None
    twin = plain_text_twin(tokenizer)
    plain: list[int] = []
    others: list[int] = []
    for i, text in enumerate(texts):
        (plain if twin is not None and is_plain(text) else others).append(i)
    side = tokenizer.truncation_side
    with encoding_lock:
        if not plain:
            encodings = _encode(backend, texts, limit, side)
        elif not others:
            encodings = _encode(twin, texts, limit, side)
        else:
            encodings = [None] * len(texts)
            for indices, encoder in ((plain, twin), (others, backend)):
                done = _encode(encoder, [texts[i] for i in indices], limit, side)
                for i, encoding in zip(indices, done, strict=True):
                    encodings[i] = encoding
    return [e.ids for e in encodings], [e.type_ids for e in encodings] if types else None


def _encode(backend: Any, texts: list[str], limit: int, side: str) -> list[Any]:
    backend.enable_truncation(limit, direction=side)
    backend.no_padding()
    # Without the character offsets nobody here reads: a sixth less CPU (tokenizers
    # >= 0.21 has it).
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return encode(texts)


def is_plain(text: str) -> bool:
    """Printable ASCII only: nothing for a BERT normaliser to do but lowercase."""
    return text.isascii() and text.isprintable()


def plain_text_twin(tokenizer: Any) -> Any | None:
    """A copy of a fast tokenizer's Rust backend that gives the same ids for `is_plain`
    texts with less work, or None where none does (made once per tokenizer).

    A BERT normaliser (MiniLM, BGE, most English encoders) removes control characters,
    turns whitespace into spaces, splits CJK characters apart, strips accents (a
    Unicode decomposition of every text) and lowercases: on printable ASCII all of that
    but lowercasing leaves the text as it was, and it was a third of the tokenizer's
    time (MiniLM, texts of 5-40 words: 35.7 -> 24.3 us per text on this CPU)."""
    twin = getattr(tokenizer, "_shoal_plain_twin", _UNSET)
    if twin is _UNSET:
        twin = _twin_of(tokenizer.backend_tokenizer)
        tokenizer._shoal_plain_twin = twin
    return twin


_UNSET = object()


def _twin_of(backend: Any) -> Any | None:
    from tokenizers import Tokenizer, normalizers

    normalizer = backend.normalizer
    if not isinstance(normalizer, normalizers.BertNormalizer):
        return None
    twin = Tokenizer.from_str(backend.to_str())
    twin.normalizer = normalizers.Lowercase() if normalizer.lowercase else None
    return twin
