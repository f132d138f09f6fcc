"""What both sides of a parity check share: the result and reference types, and
small helpers (probe names, cosines, the length both sides truncate to)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from app.onboard import probes

if TYPE_CHECKING:
    from tasks.catalog import ModelEntry


Outputs = dict[str, Any]  # a family's outputs on the probes, the same keys for both sides

NEW_TOKENS = 16  # greedy tokens per generation probe: enough to diverge, cheap on a CPU


@dataclass
class ParityResult:
    figures: dict[str, float]  # figure name -> value, e.g. {"cosine_min": 0.99998}
    ok: bool
    tolerance: str  # the stated tolerance, e.g. "cosine_min >= 0.999, norm_max_rel_diff <= 0.001"
    detail: str  # one line: what differed, at which probe (empty when ok)
    library: str  # what produced the expected outputs


@dataclass
class Reference:
    """The reference library's outputs on the probes for one entry's settings (fp32, CPU)."""

    family: str
    library: str
    outputs: Outputs
    settings: str  # `settings_key` of the entry it was computed for
    note: str = ""  # why a family was not checked (no reference could be computed)


class ShoalRefused(RuntimeError):
    """Shoal's adapter answered a probe with an error: a parity failure, not a crash."""


def settings_key(entry: ModelEntry) -> str:
    """What a reference depends on: one is reused only for an entry with the same key."""
    fields = entry.model_dump(include={"adapter", "source", "pooling", "normalize", "prompts",
                                       "max_seq_length", "dims", "defaults"})
    return json.dumps(fields, sort_keys=True, default=str)


def short(text: str, width: int = 28) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 1] + "…")


def text_probe(i: int, kind: str = "") -> str:
    return f"{kind + ' ' if kind else ''}text {i} {short(probes.TEXTS[i])}"


def prompt_kinds(entry: ModelEntry) -> list[str]:
    """The input types to probe: queries and documents when the entry has prompts."""
    return ["query", "document"] if entry.prompts.query or entry.prompts.document else \
        ["document"]


def prompt_of(entry: ModelEntry, kind: str) -> str:
    return entry.prompts.query if kind == "query" else entry.prompts.document


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = (a * b).sum(axis=-1)
    both_zero = (na == 0) & (nb == 0)  # an empty sparse vector on both sides agrees
    return np.where(both_zero, 1.0, dot / np.maximum(na * nb, 1e-30))


def _rel_diffs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    return np.abs(na - nb) / np.maximum(nb, 1e-12)


def truncation_limit(tokenizer: Any, config: Any, wanted: int | None) -> int:
    """The entry's max_seq_length, else the tokenizer's own limit, within the positions
    the model has: the length both sides truncate to."""
    limit = wanted
    if limit is None and 0 < tokenizer.model_max_length < 1_000_000:  # not "no limit" (1e30)
        limit = int(tokenizer.model_max_length)
    bounds = [n for n in (limit, getattr(config, "max_position_embeddings", None)) if n]
    return min(bounds) if bounds else 512


def capped_length(wanted: int | None, config: Any) -> int | None:
    """The entry's max_seq_length within the model's positions, as shoal caps it (a longer
    one would make the reference library index past its position embeddings)."""
    if config is None:
        return wanted
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    return min(wanted, positions) if wanted and positions else wanted


def st_transformer_config(model: Any) -> Any:
    """The transformers config of a sentence-transformers model's first module, if any."""
    return getattr(getattr(model[0], "auto_model", None), "config", None)


def library_version(module: str) -> str:
    from importlib.metadata import version

    return f"{module} {version(module)}"


# Figures: name -> (value, the probe where it is worst).
Figures = dict[str, tuple[float, str]]


def lowest(values: Sequence[float], names: Sequence[str]) -> tuple[float, str]:
    i = int(np.argmin(values))
    return float(values[i]), names[i]


def highest(values: Sequence[float], names: Sequence[str]) -> tuple[float, str]:
    i = int(np.argmax(values))
    return float(values[i]), names[i]


def vector_figures(ref: Outputs, ours: Outputs, keys: Sequence[str],
                    names: Callable[[str], list[str]]) -> Figures:
    """cosine_min/mean and norm_max_rel_diff over the rows of every key (query, document,
    image): each row one probe."""
    cosines: list[float] = []
    norms: list[float] = []
    where: list[str] = []
    for key in keys:
        if ours[key].shape != ref[key].shape:  # another width: no cosine to take
            what = (f"{key} vectors: shoal gives {ours[key].shape[-1]} dims, the reference "
                    f"{ref[key].shape[-1]}")
            return {"cosine_min": (0.0, what), "cosine_mean": (0.0, what)}
        cosines += cosine_rows(ours[key], ref[key]).tolist()
        norms += _rel_diffs(ours[key], ref[key]).tolist()
        where += names(key)
    return {"cosine_min": lowest(cosines, where),
            "cosine_mean": (float(np.mean(cosines)), ""),
            "norm_max_rel_diff": highest(norms, where)}


def text_names(key: str) -> list[str]:
    kind = "" if key == "document" else key
    return [text_probe(i, kind) for i in range(len(probes.TEXTS))]
