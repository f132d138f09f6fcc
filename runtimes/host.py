"""The model host: loads the served models and runs batches of requests.

One host per device. It runs either inside the worker on a dedicated thread
or, behind a socket, in its own process (`runtimes.server`); it keeps no
reference to the broker, so both compute the same thing.

An inference exception propagates out of `run_batch`: the caller decides
which request is to blame (`runtimes.process` bisects the batch). Only
problems found by checking a request before inference are per-request
outcomes here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
import torch

from app.catalog import ModelEntry
from runtimes.base import Outcome, Request
from runtimes.pytorch.dense import DenseEncoder, normalize_rows
from runtimes.sources import resolve_source
from tasks.errors import ErrorCode, ShoalError
from tasks.schema import EncodeRequest, parse_encode

log = logging.getLogger(__name__)


class ModelHost:
    """Holds loaded models by id and runs encode batches on them."""

    def __init__(self, device: str = "cpu", threads: int = 0, chunk_tokens: int = 16_384) -> None:
        self.device = device
        self.chunk_tokens = chunk_tokens
        if threads > 0:
            torch.set_num_threads(threads)
        self._models: dict[str, DenseEncoder] = {}

    def load(self, entries: Iterable[ModelEntry]) -> None:
        for entry in entries:
            started = time.perf_counter()
            ref, local = resolve_source(entry.source)
            self._models[entry.id] = _encoder_class(entry.adapter)(
                ref,
                local=local,
                device=self.device,
                pooling=entry.pooling,
                normalize=entry.normalize,
                max_seq_length=entry.max_seq_length,
                chunk_tokens=self.chunk_tokens,
            )
            log.info("loaded %s in %.1fs", entry.id, time.perf_counter() - started)

    def run_batch(self, model_id: str, requests: list[Request]) -> list[Outcome]:
        encoder = self._models.get(model_id)
        if encoder is None:
            return [_failed(r.id, ErrorCode.MODEL_NOT_FOUND, f"this worker does not serve "
                            f"{model_id}") for r in requests]
        outcomes: dict[str, Outcome] = {}
        runnable: list[tuple[Request, EncodeRequest]] = []
        for request in requests:
            try:
                if not isinstance(request.kwargs, dict):
                    raise ShoalError(ErrorCode.VALIDATION_ERROR, "task kwargs must be an object")
                if request.op != "encode":
                    raise ShoalError(ErrorCode.UNSUPPORTED_OPERATION,
                                     f"{model_id} does not support '{request.op}'")
                parsed = parse_encode(request.kwargs, encoder.dims)
                if not parsed.truncate:
                    _check_lengths(encoder, parsed.texts)
                runnable.append((request, parsed))
            except ShoalError as exc:
                outcomes[request.id] = _failed(request.id, exc.code, exc.message)
        if runnable:
            outcomes.update(self._encode(encoder, model_id, runnable))
        return [outcomes[r.id] for r in requests]

    def _encode(
        self, encoder: DenseEncoder, model_id: str, batch: list[tuple[Request, EncodeRequest]]
    ) -> dict[str, Outcome]:
        started = time.perf_counter()
        texts = [t for _, parsed in batch for t in parsed.texts]
        tokens = encoder.tokenize(texts)
        vectors = encoder.embed(tokens)
        inference_ms = (time.perf_counter() - started) * 1000
        outcomes: dict[str, Outcome] = {}
        stats = {"requests": len(batch), "items": len(texts), "inference_ms": inference_ms}
        offset = 0
        for request, parsed in batch:
            n = len(parsed.texts)
            rows = vectors[offset : offset + n]
            used_tokens = sum(len(ids) for ids in tokens.input_ids[offset : offset + n])
            offset += n
            if parsed.dimensions is not None:
                rows = rows[:, : parsed.dimensions]
            if encoder.normalize if parsed.normalize is None else parsed.normalize:
                rows = normalize_rows(rows)
            rows = np.ascontiguousarray(rows, dtype="<f4")
            outcomes[request.id] = Outcome(
                request.id,
                result={
                    "model": model_id,
                    "dims": int(rows.shape[1]),
                    "count": n,
                    "dtype": "float32",
                    "embeddings": rows.tobytes(),
                    "usage": {"tokens": used_tokens},
                    "batch": stats,
                },
            )
        return outcomes

    def close(self) -> None:
        self._models.clear()


def _encoder_class(adapter: str) -> type[DenseEncoder]:
    if adapter == "dense-faulty":
        # Imported only when asked for: it exists to crash processes in tests.
        from runtimes.pytorch.faulty import FaultyDenseEncoder

        return FaultyDenseEncoder
    return DenseEncoder


def _check_lengths(encoder: DenseEncoder, texts: list[str]) -> None:
    for i, length in enumerate(encoder.untruncated_lengths(texts)):
        if length > encoder.max_seq_length:
            raise ShoalError(
                ErrorCode.INPUT_TOO_LONG,
                f"items[{i}] has {length} tokens, over the model's {encoder.max_seq_length}; "
                "shorten it or set options.truncate to true",
            )


def _failed(request_id: str, code: str, message: str) -> Outcome:
    return Outcome(request_id, error_code=str(code), error_message=message)
