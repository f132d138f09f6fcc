"""Comparing the two sides: a few figures per family, each with the probe where it is
worst, held to the tolerances."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from app.onboard import probes
from app.onboard.parity.common import (
    Figures,
    Outputs,
    ParityResult,
    Reference,
    cosine_rows,
    highest,
    lowest,
    prompt_kinds,
    short,
    text_names,
    text_probe,
    vector_figures,
)
from app.onboard.parity.ours import generation_items
from app.onboard.parity.tolerances import stated, tolerance_of

if TYPE_CHECKING:
    from tasks.catalog import ModelEntry


def _figures_vectors(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    return vector_figures(ref, ours, prompt_kinds(entry), text_names)


def _figures_clip(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    def names(key: str) -> list[str]:
        if key == "image":
            return [f"image {i} ({w}x{h})" for i, (w, h) in enumerate(probes.IMAGE_SIZES)]
        return text_names(key)

    return vector_figures(ref, ours, [*prompt_kinds(entry), "image"], names)


def _top(row: np.ndarray, k: int = 10) -> set[int]:
    heavy = np.argsort(-row, kind="stable")[:k]
    return {int(i) for i in heavy if row[i] > 0}


def _figures_sparse(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    figures = _figures_vectors(entry, ref, ours, slack)
    overlaps, where = [], []
    for kind in prompt_kinds(entry):
        for i, (mine, theirs) in enumerate(zip(ours[kind], ref[kind], strict=True)):
            expected = _top(theirs)
            overlaps.append(len(_top(mine) & expected) / max(len(expected), 1))
            where.append(text_probe(i, "" if kind == "document" else kind))
    mean = float(np.mean(overlaps))
    figures["top10_overlap"] = (mean, lowest(overlaps, where)[1])
    return figures


def _figures_multivector(entry: ModelEntry, ref: Outputs, ours: Outputs,
                         slack: float) -> Figures:
    cosines, lengths, where = [], [], []
    for i, (mine, theirs) in enumerate(zip(ours["document"], ref["document"], strict=True)):
        same = mine.shape == theirs.shape
        lengths.append(1.0 if same else 0.0)
        cosines.append(float(cosine_rows(mine, theirs).min()) if same else -1.0)
        where.append(text_probe(i) + ("" if same else
                                       f" ({len(mine)} token vectors, expected {len(theirs)})"))
    agree = float(np.mean(lengths))
    return {"cosine_min": lowest(cosines, where),
            "cosine_mean": (float(np.mean([c for c in cosines if c > -1] or [0.0])), ""),
            "lengths_agree": (agree, lowest(lengths, where)[1])}


def _ranks_agree(mine: np.ndarray, theirs: np.ndarray, slack: float) -> bool:
    """Every two documents in the reference's order, unless it scores them within `slack`."""
    return all(mine[a] > mine[b] for a in range(len(theirs)) for b in range(len(theirs))
               if theirs[a] - theirs[b] > slack)


def _figures_score(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    diffs = np.abs(ours["scores"] - ref["scores"])
    names = [f"pair {i} ({short(q, 20)}, {short(d, 20)})"
             for i, (q, d) in enumerate(probes.PAIRS)]
    agree, where, start = [], [], 0
    for q, (query, documents) in enumerate(probes.QUERY_DOCUMENTS):
        span = slice(start, start + len(documents))
        same = _ranks_agree(ours["scores"][span], ref["scores"][span], slack)
        agree.append(1.0 if same else 0.0)
        where.append(f"query {q} {short(query)}")
        start += len(documents)
    return {"score_max_abs_diff": highest(diffs.tolist(), names),
            "rank_agree": (float(np.mean(agree)), lowest(agree, where)[1])}


def _figures_labels(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    mine, theirs = ours["scores"], ref["scores"]
    if ours["labels"] != ref["labels"] or mine.shape != theirs.shape:
        return {"labels_agree": (0.0, f"the label sets: {ours['labels']} against "
                                      f"{ref['labels']}")}
    labels = ref["labels"]
    # Our top label agrees where the reference scores it within `slack` of its own top.
    ours_top = np.nanargmax(mine, axis=1)
    chosen = np.take_along_axis(theirs, ours_top[:, None], axis=1)[:, 0]
    same = (chosen >= np.nanmax(theirs, axis=1) - slack).astype(float)
    where = [text_probe(i) + f" (top {labels[int(np.nanargmax(mine[i]))]!r}, expected "
             f"{labels[int(np.nanargmax(theirs[i]))]!r})" for i in range(len(mine))]
    diffs = np.nan_to_num(np.abs(mine - theirs), nan=1.0).max(axis=1)
    return {"labels_agree": (float(same.mean()), lowest(same.tolist(), where)[1]),
            "score_max_abs_diff": highest(diffs.tolist(), [text_probe(i)
                                                         for i in range(len(mine))])}


def _figures_spans(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    agree, diffs, where = [], [], []
    for i, (mine, theirs) in enumerate(zip(ours["spans"], ref["spans"], strict=True)):
        expected = {(s, e, label): score for s, e, label, score in theirs}
        got = {(s, e, label): score for s, e, label, score in mine}
        agree.append(1.0 if set(got) == set(expected) else 0.0)
        common = set(got) & set(expected)
        diffs.append(max((abs(got[k] - expected[k]) for k in common), default=0.0))
        missing = sorted(set(expected) - set(got))[:1] or sorted(set(got) - set(expected))[:1]
        where.append(text_probe(i) + (f" (span {missing[0]} on one side only)"
                                       if missing else ""))
    return {"spans_agree": (float(np.mean(agree)), lowest(agree, where)[1]),
            "score_max_abs_diff": highest(diffs, where)}


def _figures_texts(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    items = generation_items(len(ref["texts"]) > len(probes.COMPLETION_PROMPTS))
    agree, where = [], []
    for i, (mine, theirs, item) in enumerate(zip(ours["texts"], ref["texts"], items,
                                                 strict=True)):
        agree.append(1.0 if mine == theirs else 0.0)
        prompt = item.get("text") or item["messages"][-1]["content"]
        where.append(f"prompt {i} {short(prompt)} (got {short(mine, 24)}, expected "
                     f"{short(theirs, 24)})")
    return {"tokens_agree": (float(np.mean(agree)), lowest(agree, where)[1])}


# Each takes the score tolerance (`slack`): two labels or documents the reference scores
# within it of each other may come out in either order without counting as a disagreement.
_COMPARE: dict[str, Callable[[ModelEntry, Outputs, Outputs, float], Figures]] = {
    "dense": _figures_vectors,
    "sparse": _figures_sparse,
    "clip": _figures_clip,
    "multivector": _figures_multivector,
    "cross-encoder": _figures_score,
    "sequence-classification": _figures_labels,
    "zero-shot": _figures_labels,
    "token-classification": _figures_spans,
    "causal-lm": _figures_texts,
}


def _failing(figures: Figures, bounds: dict[str, tuple[str, float]]) -> str:
    """The first figure outside its bound, as a one-line detail; "" if none."""
    for name, (op, bound) in bounds.items():
        if name not in figures:
            return f"{name} was not measured"
        value, worst = figures[name]
        holds = value >= bound if op == ">=" else value <= bound
        if not holds or np.isnan(value):
            return f"{name} {value:.6g} (needs {op} {bound:g}); worst at {worst}"
    return ""


def compare(entry: ModelEntry, reference: Reference, ours: Outputs,
            precision: str) -> ParityResult:
    """Shoal's outputs against the reference's, held to the family's tolerance at
    `precision`."""
    bounds = tolerance_of(entry.adapter, precision)
    if reference.note:
        return ParityResult({}, True, stated(bounds), reference.note, reference.library)
    slack = bounds.get("score_max_abs_diff", ("<=", 0.0))[1]
    figures = _COMPARE[entry.adapter](entry, reference.outputs, ours, slack)
    detail = _failing(figures, bounds)
    values = {name: round(value, 7) for name, (value, _) in figures.items()}
    return ParityResult(values, not detail, stated(bounds), detail, reference.library)
