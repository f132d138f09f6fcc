"""Text helpers every PyTorch adapter uses: length limits, padding, chunking."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from itertools import chain

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from runtimes.pytorch import emulated
from tasks.errors import ErrorCode, ShoalError

# Tokenizers without a limit report a huge sentinel (int(1e30)).
GPU_WIDTH_MULTIPLE = 16
_NO_LIMIT = 1_000_000


def max_length(tokenizer: PreTrainedTokenizerBase, model_config: object,
               *wanted: int | None) -> int:
    """The sequence limit: the first of `wanted` given (catalog, model files), then the
    tokenizer's own, never over the model's position embeddings."""
    limit = next((n for n in wanted if n), None)
    if limit is None and tokenizer.model_max_length < _NO_LIMIT:
        limit = tokenizer.model_max_length
    positions = getattr(model_config, "max_position_embeddings", None)
    limits = [n for n in (limit, positions) if n]
    return min(limits) if limits else 512


_encoding = threading.Lock()  # a fast tokenizer's truncation setting is shared state


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str], limit: int
                 ) -> tuple[list[list[int]], list[list[int]] | None]:
    """Token ids (and token type ids, where the model takes them) of `texts`, special
    tokens added, truncated to `limit`: what `tokenizer(texts, truncation=True,
    max_length=limit)` gives, straight from a fast tokenizer's Rust encoder (its batch
    runs on several threads where TOKENIZERS_PARALLELISM allows) without transformers'
    conversion of every encoding to dicts of lists (a fifth of the runtime's CPU
    under load)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
    types = "token_type_ids" in tokenizer.model_input_names
    if backend is None:
        encoded = tokenizer(texts, truncation=True, max_length=limit, padding=False)
        return encoded["input_ids"], encoded.get("token_type_ids") if types else None
    with _encoding:
        backend.enable_truncation(limit, direction=tokenizer.truncation_side)
        backend.no_padding()
        # Without the character offsets nobody here reads: a sixth less CPU (tokenizers
        # >= 0.21 has it).
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        encodings = encode(texts)
    return [e.ids for e in encodings], [e.type_ids for e in encodings] if types else None


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


def pad(rows: Sequence[Sequence[int]], value: int, left: bool = False,
        multiple: int = 1) -> torch.Tensor:
    """A (len(rows), longest) long tensor, padded with `value` on the right (or left); its
    width rounded up to a `multiple`.

    One numpy pass over all the rows (a masked assignment fills row-major, the rows'
    own order), not a tensor per row: the per-row loop was a third of the runtime's CPU."""
    lengths = _lengths(rows)
    return _placed(rows, lengths, filled(lengths, left, multiple), value)


def _lengths(rows: Sequence[Sequence[int]]) -> np.ndarray:
    return np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))


def _placed(rows: Sequence[Sequence[int]], lengths: np.ndarray, mask: np.ndarray,
            value: int) -> torch.Tensor:
    """`rows` laid into `mask`'s places (row-major, their own order), `value` elsewhere."""
    out = np.full(mask.shape, value, dtype=np.int64)
    out[mask] = np.fromiter(chain.from_iterable(rows), dtype=np.int64,
                            count=int(lengths.sum()))
    return torch.from_numpy(out)


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


def encoder_inputs(input_ids: Sequence[Sequence[int]],
                   token_type_ids: Sequence[Sequence[int]] | None, pad_id: int,
                   device: str, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask (and token_type_ids) on `device`, as wide
    as the longest row rounded up to a `multiple`."""
    # One mask for the three: token type rows are as long as their id rows.
    lengths = _lengths(input_ids)
    mask = filled(lengths, multiple=multiple)
    inputs = {
        "input_ids": _placed(input_ids, lengths, mask, pad_id),
        "attention_mask": torch.from_numpy(mask.astype(np.int64)),
    }
    if token_type_ids is not None:
        inputs["token_type_ids"] = _placed(token_type_ids, lengths, mask, 0)
    return to_device(staged(inputs, device), device)


def staged(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """Host tensors ready to go to `device`: in pinned (page-locked) memory for a GPU, so
    the copy can run without the host waiting for it."""
    if not device.startswith("cuda"):
        return tensors
    return {k: v.pin_memory() for k, v in tensors.items()}


def to_device(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """`staged` tensors on `device`; to a GPU without blocking the host (the copy is
    queued on the stream ahead of the forward that reads it)."""
    if not device.startswith("cuda"):
        return {k: v.to(device) for k, v in tensors.items()}
    return {k: v.to(device, non_blocking=True) for k, v in tensors.items()}


def host_chunks(input_ids: Sequence[Sequence[int]],
                token_type_ids: Sequence[Sequence[int]] | None, pad_id: int, device: str,
                budget: int, limit: int | None = None
                ) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """`padded_chunks`' chunks as host tensors `staged` for `device`: a batch's `plan`.

    On a GPU, for a model whose length `limit` is a multiple of GPU_WIDTH_MULTIPLE, the
    width is rounded up to a multiple of it: each new (rows, width) shape costs the
    device a first-time choice of kernels, and rows of every length from 1 to 512 tokens
    would make hundreds of them."""
    multiple = GPU_WIDTH_MULTIPLE if device.startswith("cuda") else 1
    if multiple > 1 and (limit is None or limit % multiple):
        multiple = 1  # a rounded width could pass the model's limit (its positions)
    return [(chunk, staged(inputs, device)) for chunk, inputs in
            padded_chunks(input_ids, token_type_ids, pad_id, "cpu", budget, multiple)]


class HostCopy:
    """Device outputs on their way to host memory: `wait()` gives them once copied.

    On a GPU the copy is queued behind the forward that makes them (into pinned memory),
    and an event marks its end, so the device stage moves on to the next batch at once.
    Made right after passes run inside `emulated.queued_passes()`, it waits for those
    instead, as for a GPU's copy."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        self._emulated_until = emulated.queued_until()
        self._event = None
        if outputs and outputs[0].is_cuda:
            host = [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) for o in outputs]
            for target, output in zip(host, outputs, strict=True):
                target.copy_(output, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            outputs = host
        self._outputs = outputs

    def wait(self) -> list[torch.Tensor]:
        emulated.wait_queued(self._emulated_until)
        self._emulated_until = None
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._outputs


def padded_chunks(input_ids: Sequence[Sequence[int]],
                  token_type_ids: Sequence[Sequence[int]] | None, pad_id: int, device: str,
                  budget: int, multiple: int = 1
                  ) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """(indices, model inputs) per chunk of `length_chunks`: what every encoder loop runs."""
    for chunk in length_chunks([len(ids) for ids in input_ids], budget):
        types = None if token_type_ids is None else [token_type_ids[i] for i in chunk]
        yield chunk, encoder_inputs([input_ids[i] for i in chunk], types, pad_id, device,
                                    multiple)
