"""A dense encoder that misbehaves on marker texts, for tests of the runtime process.

Catalog `adapter: dense-faulty`. Refused unless SHOAL_ALLOW_TEST_ADAPTERS=1,
since one request could otherwise take a production worker down on purpose.
The fault happens in `embed`, where a real model would fail (inference, not
validation); texts without markers get the same vectors as `dense`.

Markers (anywhere in a text):
  @@crash@@  a real segfault (read of address 0), like a broken kernel or extension
  @@raise@@  a Python RuntimeError, like a bad shape or a CUDA error message
  @@slow@@   sleeps SHOAL_FAULTY_SLOW_S seconds (default 3) before computing
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass

import numpy as np

from runtimes.pytorch.dense import DenseAdapter, DenseEncoder, Tokenized

ALLOW_ENV = "SHOAL_ALLOW_TEST_ADAPTERS"
CRASH, RAISE, SLOW = "@@crash@@", "@@raise@@", "@@slow@@"


class AdapterRefused(RuntimeError):
    pass


@dataclass(frozen=True)
class _MarkedTokens(Tokenized):
    # The markers seen by tokenize, carried to embed (which sees only token ids).
    markers: frozenset[str] = frozenset()


def refuse_unless_allowed() -> None:
    if os.environ.get(ALLOW_ENV) != "1":
        raise AdapterRefused(
            "adapter 'dense-faulty' crashes its process on purpose and exists for tests "
            f"only; set {ALLOW_ENV}=1 to load it"
        )


class FaultyDenseEncoder(DenseEncoder):
    def __init__(self, model_ref: str, **kwargs) -> None:
        refuse_unless_allowed()
        super().__init__(model_ref, **kwargs)


    def tokenize(self, texts: list[str]) -> Tokenized:
        tokens = super().tokenize(texts)
        markers = frozenset(m for m in (CRASH, RAISE, SLOW) if any(m in t for t in texts))
        return _MarkedTokens(tokens.input_ids, tokens.token_type_ids, markers)

    def embed(self, tokens: Tokenized) -> np.ndarray:
        markers = getattr(tokens, "markers", frozenset())
        if CRASH in markers:
            ctypes.string_at(0)  # SIGSEGV: the process dies without unwinding
        if RAISE in markers:
            raise RuntimeError(f"faulty adapter: input contains {RAISE}")
        if SLOW in markers:
            time.sleep(float(os.environ.get("SHOAL_FAULTY_SLOW_S", "3")))
        return super().embed(tokens)


class FaultyDenseAdapter(DenseAdapter):
    encoder_class = FaultyDenseEncoder
