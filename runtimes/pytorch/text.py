"""Text helpers every PyTorch adapter uses: padded tensors, chunks on the device's side
(the torch-free ones, limits and chunking, are `runtimes.families.text`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from runtimes.families.text import (
    check_lengths,
    chunked_inputs,
    encode_texts,
    filled,
    length_chunks,
    max_length,
    padded,
    padded_inputs,
    row_lengths,
    too_long,
)
from runtimes.pytorch import device_seam

__all__ = [
    "check_lengths", "encode_texts", "filled", "length_chunks", "max_length", "too_long",
]

GPU_WIDTH_MULTIPLE = 16


def pad(rows: Sequence[Sequence[int]], value: int, left: bool = False,
        multiple: int = 1) -> torch.Tensor:
    """A (len(rows), longest) long tensor, padded with `value` on the right (or left); its
    width rounded up to a `multiple`.

    One numpy pass over all the rows (a masked assignment fills row-major, the rows'
    own order), not a tensor per row: the per-row loop was a third of the runtime's CPU."""
    lengths = row_lengths(rows)
    return torch.from_numpy(padded(rows, lengths, filled(lengths, left, multiple), value))


def encoder_inputs(input_ids: Sequence[Sequence[int]],
                   token_type_ids: Sequence[Sequence[int]] | None, pad_id: int,
                   device: str, multiple: int = 1) -> dict[str, torch.Tensor]:
    """`runtimes.families.text.padded_inputs` as tensors on `device`."""
    inputs = padded_inputs(input_ids, token_type_ids, pad_id, multiple)
    return to_device(staged(as_tensors(inputs), device), device)


def as_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


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
    Made right after passes ran inside the device seam's `queued()`
    (`runtimes.pytorch.device_seam`: a stand-in device may queue them), it waits for those
    too, as for a GPU's copy."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        self._seam = device_seam.current()
        self._queued_until = self._seam.queued_until()
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
        if self._queued_until is not None:
            self._seam.wait_queued(self._queued_until)
            self._queued_until = None
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._outputs


def padded_chunks(input_ids: Sequence[Sequence[int]],
                  token_type_ids: Sequence[Sequence[int]] | None, pad_id: int, device: str,
                  budget: int, multiple: int = 1
                  ) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """`runtimes.families.text.chunked_inputs` as tensors on `device`: what every encoder loop
    runs."""
    for chunk, inputs in chunked_inputs(input_ids, token_type_ids, pad_id, budget, multiple):
        yield chunk, to_device(staged(as_tensors(inputs), device), device)
