"""Shoal's side of a parity check: its adapter on the probes, through a `ModelHost`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from app.onboard import probes
from app.onboard.parity.common import NEW_TOKENS, Outputs, ShoalRefused, prompt_kinds
from tasks.engines import DEFAULT

if TYPE_CHECKING:
    from runtimes.child_side.host import ModelHost
    from tasks.catalog import ModelEntry


def _ask(host: ModelHost, entry: ModelEntry, op: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    from runtimes.base import Request

    (outcome,) = host.run_batch(entry.id, [Request("parity", op, {"model": entry.id, **kwargs})])
    if not outcome.ok or outcome.result is None:
        raise ShoalRefused(f"shoal answered a {op} probe with {outcome.error_code}: "
                           f"{outcome.error_message}")
    return outcome.result


def _text_items(texts: Sequence[str]) -> list[dict[str, str]]:
    return [{"text": t} for t in texts]


def _dense_rows(result: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(result["embeddings"], dtype="<f4").reshape(result["count"],
                                                                     result["dims"])


def _sparse_rows(result: dict[str, Any]) -> np.ndarray:
    rows = np.zeros((result["count"], result["vocab_size"]), dtype=np.float32)
    for row, vector in zip(rows, result["embeddings"], strict=True):
        row[vector["indices"]] = vector["values"]
    return rows


def _shoal_encode(host: ModelHost, entry: ModelEntry) -> Outputs:
    decode = _sparse_rows if entry.adapter == "sparse" else _dense_rows
    return {kind: decode(_ask(host, entry, "encode", {
        "items": _text_items(probes.TEXTS), "options": {"is_query": kind == "query"}}))
        for kind in prompt_kinds(entry)}


def _shoal_clip(host: ModelHost, entry: ModelEntry) -> Outputs:
    out = _shoal_encode(host, entry)
    images = [{"image": probes.png_bytes(image)} for image in probes.probe_images()]
    out["image"] = _dense_rows(_ask(host, entry, "encode", {"items": images}))
    return out


def _shoal_multivector(host: ModelHost, entry: ModelEntry) -> Outputs:
    result = _ask(host, entry, "encode", {"items": _text_items(probes.TEXTS)})
    flat = np.frombuffer(result["embeddings"], dtype="<f4").reshape(-1, result["dims"])
    bounds = np.cumsum([0, *result["lengths"]])
    return {"document": [flat[a:b] for a, b in pairwise(bounds)]}


def _shoal_score(host: ModelHost, entry: ModelEntry) -> Outputs:
    scores: list[float] = []
    for query, documents in probes.QUERY_DOCUMENTS:
        scores += _ask(host, entry, "score", {"query": query,
                                              "items": _text_items(documents)})["scores"]
    return {"scores": np.array(scores, dtype=np.float64)}


def label_scores(rows: list[list[dict[str, Any]]], labels: Sequence[str]) -> np.ndarray:
    """(texts, labels) scores in `labels` order from per-text {label, score} lists."""
    index = {label: j for j, label in enumerate(labels)}
    out = np.full((len(rows), len(labels)), np.nan)
    for i, row in enumerate(rows):
        for item in row:
            out[i, index[item["label"]]] = item["score"]
    return out


def _shoal_classify(host: ModelHost, entry: ModelEntry) -> Outputs:
    options: dict[str, Any] = {}
    if entry.adapter == "zero-shot":
        labels: list[str] = list(probes.ZERO_SHOT_LABELS)
        options["labels"] = labels
    else:
        labels = [str(label) for label in host.adapter(entry.id).labels]  # type: ignore[union-attr]
    result = _ask(host, entry, "classify", {"items": _text_items(probes.TEXTS),
                                            "options": options})
    return {"labels": labels, "scores": label_scores(result["labels"], labels)}


def aggregation(entry: ModelEntry) -> str:
    return str(entry.defaults.get("aggregation", "simple"))


def _shoal_extract(host: ModelHost, entry: ModelEntry) -> Outputs:
    # Threshold 0: every entity the model tags, as the pipeline gives them.
    result = _ask(host, entry, "extract", {
        "items": _text_items(probes.TEXTS),
        "options": {"aggregation": aggregation(entry), "threshold": 0.0}})
    return {"spans": [[(e["start"], e["end"], e["label"], e["score"]) for e in entities]
                      for entities in result["entities"]]}


def generation_items(has_chat_template: bool) -> list[dict[str, Any]]:
    """The generation probes: completions, and chats where the model has a template."""
    items: list[dict[str, Any]] = [{"text": p} for p in probes.COMPLETION_PROMPTS]
    if has_chat_template:
        items += [{"messages": list(m)} for m in probes.CHAT_PROMPTS]
    return items


def _shoal_generate(host: ModelHost, entry: ModelEntry) -> Outputs:
    adapter = host.adapter(entry.id)
    chat = bool(getattr(adapter, "tokenizer", None) and adapter.tokenizer.chat_template)  # type: ignore[union-attr]
    result = _ask(host, entry, "generate", {
        "items": generation_items(chat),
        "options": {"max_tokens": NEW_TOKENS, "temperature": 0.0}})
    return {"texts": [choice["text"] for choice in result["choices"]]}


_SHOAL: dict[str, Callable[[ModelHost, ModelEntry], Outputs]] = {
    "dense": _shoal_encode,
    "sparse": _shoal_encode,
    "clip": _shoal_clip,
    "multivector": _shoal_multivector,
    "cross-encoder": _shoal_score,
    "sequence-classification": _shoal_classify,
    "zero-shot": _shoal_classify,
    "token-classification": _shoal_extract,
    "causal-lm": _shoal_generate,
}


def shoal_outputs(entry: ModelEntry, engine: str = DEFAULT, precision: str = "fp32") -> Outputs:
    """Shoal's adapter on the probes, loaded by a `ModelHost` on the CPU, after the
    engine's `prepare` step if it has one (ONNX exports the graph at `precision` when it
    is missing)."""
    from runtimes.child_side.host import ModelHost
    from tasks import engines

    if entry.adapter not in _SHOAL:
        raise ValueError(f"no parity probes for adapter {entry.adapter!r}")
    prepare = engines.engine(engine).prepare
    if prepare:
        engines.resolve(prepare)(entry, precision)
    host = ModelHost(device="cpu", precision=precision, engine=engine)
    try:
        host.load([entry])
        return _SHOAL[entry.adapter](host, entry)
    finally:
        host.close()
