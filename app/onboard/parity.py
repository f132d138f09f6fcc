"""Parity: shoal's adapter against the model's reference library, on the fixed probes.

Before onboarding writes an entry, the model is run twice on `app.onboard.probes`: by the
library its authors publish it for (sentence-transformers, a transformers pipeline, plain
transformers where no library wraps the family), in float32 on the CPU, following the
entry's settings (pooling, normalisation, prompts, max_seq_length), and by shoal's own
adapter through a `ModelHost`, on the runtime and precision being considered. `compare`
turns the two into a few figures per family and holds them to `TOLERANCES`: tight in
fp32, where both compute the same thing and only summation order differs; looser in the
reduced precisions (bf16, fp16, int8), where the numbers themselves change.

The reference is computed once per entry settings and reused for every runtime and
precision (`check_parity(..., reference=...)`); it follows the entry, not blindly the
files, so a user's different pooling choice is checked against what that choice means
in sentence-transformers, and a wrong one shows as a failed figure.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from app.onboard import probes

if TYPE_CHECKING:
    from runtimes.host import ModelHost
    from tasks.catalog import ModelEntry

Outputs = dict[str, Any]  # a family's outputs on the probes, the same keys for both sides

NEW_TOKENS = 16  # greedy tokens per generation probe: enough to diverge, cheap on a CPU
REDUCED = ("bf16", "fp16", "int8")


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


# --- tolerances ------------------------------------------------------------------------------

# Per family, per precision class: figure -> (">=" | "<=", bound).
#
# fp32: both sides compute the same float32 arithmetic in another order (chunks, padding,
# fused kernels), which moves a cosine by ~1e-7 and a probability by ~1e-7 (measured on
# every family's tiny model and on all-MiniLM-L6-v2, PyTorch and ONNX Runtime alike); the
# bounds leave three orders of magnitude for that and none for a wrong pooling, prompt,
# truncation, normalisation or activation, which move cosines by 0.1-0.8, vector lengths
# by several times and scores by 0.01 or more (MiniLM: mean pooling served as CLS gives
# cosine_min 0.18, a missing "query: " prompt 0.66, 128 tokens instead of 256 0.88).
#
# Reduced (bf16 on PyTorch, int8 on ONNX Runtime, fp16 on CUDA): bf16 keeps 8 bits of
# mantissa and int8 quantizes every matrix product, so vectors turn by a few degrees and
# probabilities move by hundredths. The bounds are what was measured with a margin, and
# stay well clear of what a wrong setting gives. Labels and rankings are compared with
# the score bound as slack: two labels (documents) the reference scores within it of each
# other may come out in either order, a near-tie the precision may decide either way.
TOLERANCES: dict[str, dict[str, dict[str, tuple[str, float]]]] = {
    # MiniLM cosine_min: 0.99999 fp32 (both runtimes), 0.99987 bf16, 0.9829 int8 ONNX (its
    # shortest text, "Hello world"; mean 0.991). int8 sets the reduced bound.
    "dense": {
        "fp32": {"cosine_min": (">=", 0.999), "norm_max_rel_diff": ("<=", 1e-3)},
        "reduced": {"cosine_min": (">=", 0.97), "norm_max_rel_diff": ("<=", 0.05)},
    },
    # Term weights over the whole vocabulary (tiny SPLADE: bf16 0.9998 and int8 0.9994
    # cosine, lengths 1.2% off in bf16). The ten heaviest terms may swap with the eleventh
    # where two weigh nearly the same, so their overlap is held looser than the cosine.
    "sparse": {
        "fp32": {"cosine_min": (">=", 0.999), "top10_overlap": (">=", 0.95),
                 "norm_max_rel_diff": ("<=", 1e-3)},
        "reduced": {"cosine_min": (">=", 0.97), "top10_overlap": (">=", 0.7),
                    "norm_max_rel_diff": ("<=", 0.1)},
    },
    # One unit vector per token: nothing averages a token's error away, so looser than the
    # pooled families (tiny ColBERT bf16: 0.99996).
    "multivector": {
        "fp32": {"cosine_min": (">=", 0.999), "lengths_agree": (">=", 1.0)},
        "reduced": {"cosine_min": (">=", 0.95), "lengths_agree": (">=", 1.0)},
    },
    "clip": {
        "fp32": {"cosine_min": (">=", 0.999), "norm_max_rel_diff": ("<=", 1e-3)},
        "reduced": {"cosine_min": (">=", 0.97), "norm_max_rel_diff": ("<=", 0.05)},
    },
    # Scores on the scale shoal serves (a probability unless the entry asks for logits);
    # tiny rerankers: bf16 0.0035, int8 0.0073 at most.
    "cross-encoder": {
        "fp32": {"score_max_abs_diff": ("<=", 1e-3), "rank_agree": (">=", 1.0)},
        "reduced": {"score_max_abs_diff": ("<=", 0.05), "rank_agree": (">=", 1.0)},
    },
    # Probabilities; tiny classifiers: bf16 0.006, int8 0.011 at most. One text of twelve
    # may change its top label beyond the slack in reduced precision.
    "sequence-classification": {
        "fp32": {"labels_agree": (">=", 1.0), "score_max_abs_diff": ("<=", 1e-3)},
        "reduced": {"labels_agree": (">=", 0.9), "score_max_abs_diff": ("<=", 0.05)},
    },
    "zero-shot": {
        "fp32": {"labels_agree": (">=", 1.0), "score_max_abs_diff": ("<=", 1e-3)},
        "reduced": {"labels_agree": (">=", 0.9), "score_max_abs_diff": ("<=", 0.05)},
    },
    # A token whose two best tags are close may flip and split, join or relabel an entity;
    # spans_agree counts whole texts, so one flip costs 1/12. Tiny random taggers, whose
    # tags are all near-ties, measured 0.67-0.92 (bf16) and 0.75 (int8); a trained tagger's
    # confident tags flip far less.
    "token-classification": {
        "fp32": {"spans_agree": (">=", 1.0), "score_max_abs_diff": ("<=", 1e-3)},
        "reduced": {"spans_agree": (">=", 0.75), "score_max_abs_diff": ("<=", 0.1)},
    },
    # Greedy decoding amplifies any change once two tokens are close: in reduced precision a
    # text may go its own way after a few tokens, which is no fault of the adapter.
    "causal-lm": {
        "fp32": {"tokens_agree": (">=", 1.0)},
        "reduced": {"tokens_agree": (">=", 0.5)},
    },
}


def precision_class(precision: str) -> str:
    return "reduced" if precision in REDUCED else "fp32"


def tolerance_of(family: str, precision: str) -> dict[str, tuple[str, float]]:
    return TOLERANCES[family][precision_class(precision)]


def stated(bounds: dict[str, tuple[str, float]]) -> str:
    return ", ".join(f"{name} {op} {bound:g}" for name, (op, bound) in bounds.items())


# --- helpers ---------------------------------------------------------------------------------


def settings_key(entry: ModelEntry) -> str:
    """What a reference depends on: one is reused only for an entry with the same key."""
    fields = entry.model_dump(include={"adapter", "source", "pooling", "normalize", "prompts",
                                       "max_seq_length", "dims", "defaults"})
    return json.dumps(fields, sort_keys=True, default=str)


def _short(text: str, width: int = 28) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 1] + "…")


def _text_probe(i: int, kind: str = "") -> str:
    return f"{kind + ' ' if kind else ''}text {i} {_short(probes.TEXTS[i])}"


def prompt_kinds(entry: ModelEntry) -> list[str]:
    """The input types to probe: queries and documents when the entry has prompts."""
    return ["query", "document"] if entry.prompts.query or entry.prompts.document else \
        ["document"]


def _prompt(entry: ModelEntry, kind: str) -> str:
    return entry.prompts.query if kind == "query" else entry.prompts.document


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = (a * b).sum(axis=-1)
    both_zero = (na == 0) & (nb == 0)  # an empty sparse vector on both sides agrees
    return np.where(both_zero, 1.0, dot / np.maximum(na * nb, 1e-30))


def _rel_diffs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    return np.abs(na - nb) / np.maximum(nb, 1e-12)


def _limit(tokenizer: Any, config: Any, wanted: int | None) -> int:
    """The entry's max_seq_length, else the tokenizer's own limit, within the positions
    the model has: the length both sides truncate to."""
    limit = wanted
    if limit is None and 0 < tokenizer.model_max_length < 1_000_000:  # not "no limit" (1e30)
        limit = int(tokenizer.model_max_length)
    bounds = [n for n in (limit, getattr(config, "max_position_embeddings", None)) if n]
    return min(bounds) if bounds else 512


def _capped(wanted: int | None, config: Any) -> int | None:
    """The entry's max_seq_length within the model's positions, as shoal caps it (a longer
    one would make the reference library index past its position embeddings)."""
    if config is None:
        return wanted
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    return min(wanted, positions) if wanted and positions else wanted


def _st_config(model: Any) -> Any:
    """The transformers config of a sentence-transformers model's first module, if any."""
    return getattr(getattr(model[0], "auto_model", None), "config", None)


def _version(module: str) -> str:
    from importlib.metadata import version

    return f"{module} {version(module)}"


# Figures: name -> (value, the probe where it is worst).
Figures = dict[str, tuple[float, str]]


def _low(values: Sequence[float], names: Sequence[str]) -> tuple[float, str]:
    i = int(np.argmin(values))
    return float(values[i]), names[i]


def _high(values: Sequence[float], names: Sequence[str]) -> tuple[float, str]:
    i = int(np.argmax(values))
    return float(values[i]), names[i]


def _vector_figures(ref: Outputs, ours: Outputs, keys: Sequence[str],
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
        cosines += _cosines(ours[key], ref[key]).tolist()
        norms += _rel_diffs(ours[key], ref[key]).tolist()
        where += names(key)
    return {"cosine_min": _low(cosines, where),
            "cosine_mean": (float(np.mean(cosines)), ""),
            "norm_max_rel_diff": _high(norms, where)}


def _text_names(key: str) -> list[str]:
    kind = "" if key == "document" else key
    return [_text_probe(i, kind) for i in range(len(probes.TEXTS))]


# --- shoal's side ----------------------------------------------------------------------------


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


def _label_scores(rows: list[list[dict[str, Any]]], labels: Sequence[str]) -> np.ndarray:
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
    return {"labels": labels, "scores": _label_scores(result["labels"], labels)}


def _aggregation(entry: ModelEntry) -> str:
    return str(entry.defaults.get("aggregation", "simple"))


def _shoal_extract(host: ModelHost, entry: ModelEntry) -> Outputs:
    # Threshold 0: every entity the model tags, as the pipeline gives them.
    result = _ask(host, entry, "extract", {
        "items": _text_items(probes.TEXTS),
        "options": {"aggregation": _aggregation(entry), "threshold": 0.0}})
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


def _graph_folder(entry: ModelEntry) -> Path:
    """Where the graph's transformer sits: a SparseEncoder save keeps it in a subfolder."""
    from runtimes.files import encoder_ref
    from runtimes.sources import resolve_source
    from runtimes.splade import read_splade_config

    ref = resolve_source(entry.source)
    if entry.adapter == "sparse":
        return Path(encoder_ref(ref, read_splade_config(ref).encoder_dir))
    return Path(ref)


def shoal_outputs(entry: ModelEntry, engine: str = "pytorch", precision: str = "fp32") -> Outputs:
    """Shoal's adapter on the probes, loaded by a `ModelHost` on the CPU. For engine
    "onnx" the graph at `precision` is exported first when it is missing."""
    from runtimes.host import ModelHost

    if entry.adapter not in _SHOAL:
        raise ValueError(f"no parity probes for adapter {entry.adapter!r}")
    if engine == "onnx":
        from runtimes.onnx.export import export_graph
        from runtimes.onnx.graphs import HEADS

        if entry.adapter not in HEADS:
            raise ValueError(f"the ONNX runtime does not serve {entry.adapter!r}")
        export_graph(_graph_folder(entry), entry.adapter, precision)
    host = ModelHost(device="cpu", precision=precision, engine=engine)
    try:
        host.load([entry])
        return _SHOAL[entry.adapter](host, entry)
    finally:
        host.close()


# --- the reference libraries -----------------------------------------------------------------


def _st_pooling(model: Any) -> tuple[int, Any | None, bool]:
    """(index of the Pooling module, it, whether a Normalize follows) of a SentenceTransformer."""
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.sentence_transformer.modules import Pooling

    modules = list(model)
    index = next((i for i, m in enumerate(modules) if isinstance(m, Pooling)), -1)
    return index, modules[index] if index >= 0 else None, any(
        isinstance(m, Normalize) for m in modules)


def _dense_model(entry: ModelEntry, folder: Path) -> tuple[Any, str]:
    """The SentenceTransformer the entry's settings describe, and how it was made."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    library = f"{_version('sentence-transformers')} SentenceTransformer"
    if (folder / "modules.json").is_file():
        model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
        index, pooling, normalized = _st_pooling(model)
        want_pooling = entry.pooling or (pooling.pooling_mode if pooling else "mean")
        want_normalize = normalized if entry.normalize is None else entry.normalize
        if pooling is not None and pooling.pooling_mode == want_pooling and \
                normalized == want_normalize:
            return model, library
        # The user chose another pooling or normalisation than the files: the model they
        # mean is the same modules with that Pooling (and a Normalize or none).
        modules = [m for m in model if not isinstance(m, Normalize | Pooling)]
        width = modules[0].get_embedding_dimension()
        modules.insert(index if index >= 0 else 1, Pooling(width, pooling_mode=want_pooling))
        if want_normalize:
            modules.append(Normalize())
        how = f" rebuilt with Pooling({want_pooling}){' + Normalize' if want_normalize else ''}"
        return SentenceTransformer(modules=modules, device="cpu"), library + how
    transformer = Transformer(str(folder), max_seq_length=entry.max_seq_length)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(),
                                    pooling_mode=entry.pooling or "mean")]
    if entry.normalize:
        modules.append(Normalize())
    how = f" from Transformer + Pooling({entry.pooling or 'mean'})" + \
        (" + Normalize" if entry.normalize else "")
    return SentenceTransformer(modules=modules, device="cpu"), library + how


def _reference_dense(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    model, library = _dense_model(entry, folder)
    if entry.max_seq_length:
        model.max_seq_length = _capped(entry.max_seq_length, _st_config(model))
    # An explicit prompt, "" included, so no default_prompt_name of the files applies.
    return {kind: model.encode(list(probes.TEXTS), prompt=_prompt(entry, kind),
                               convert_to_numpy=True, batch_size=4)
            for kind in prompt_kinds(entry)}, library


def _splade_manual(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    """SPLADE by hand on the masked LM: log(1 + relu(logits)), max over the real tokens."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForMaskedLM.from_pretrained(str(folder), local_files_only=True,
                                                 dtype=torch.float32).eval()
    limit = _limit(tokenizer, model.config, entry.max_seq_length)
    out: Outputs = {}
    for kind in prompt_kinds(entry):
        rows = []
        for text in probes.TEXTS:
            inputs = tokenizer(_prompt(entry, kind) + text, truncation=True, max_length=limit,
                               return_tensors="pt")
            with torch.inference_mode():
                logits = model(**inputs).logits[0]
            rows.append(torch.log1p(torch.relu(logits)).amax(dim=0).numpy())
        out[kind] = np.stack(rows)
    return out, f"{_version('transformers')} AutoModelForMaskedLM + SPLADE max pooling (by hand)"


def _reference_sparse(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    if not (folder / "modules.json").is_file():
        return _splade_manual(entry, folder)
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(folder), device="cpu", local_files_only=True)
    if entry.max_seq_length:
        model.max_seq_length = _capped(entry.max_seq_length, _st_config(model))
    out = {kind: model.encode(list(probes.TEXTS), prompt=_prompt(entry, kind),
                              convert_to_tensor=True, convert_to_sparse_tensor=False,
                              batch_size=4).cpu().numpy()
           for kind in prompt_kinds(entry)}
    return out, f"{_version('sentence-transformers')} SparseEncoder"


def _activation(entry: ModelEntry, num_labels: int) -> str:
    """The activation shoal's scores carry: the entry's default, else sigmoid for one
    logit and the last class's softmax for several (runtimes.classifiers)."""
    chosen = entry.defaults.get("activation")
    return str(chosen) if chosen else ("sigmoid" if num_labels == 1 else "softmax")


def _activated(logits: np.ndarray, activation: str) -> np.ndarray:
    logits = logits.reshape(len(logits), -1).astype(np.float64)
    if activation == "softmax":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (shifted / shifted.sum(axis=1, keepdims=True))[:, -1]
    if activation == "sigmoid":
        return 1 / (1 + np.exp(-logits[:, -1]))
    return logits[:, -1]


def _reference_cross_encoder(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    model = CrossEncoder(str(folder), device="cpu", local_files_only=True,
                         max_length=_capped(entry.max_seq_length, config))
    # Raw logits, then the activation shoal applies: a model saved with another activation
    # (Identity, say) is compared on the quantity shoal serves.
    logits = model.predict(list(probes.PAIRS), activation_fn=torch.nn.Identity(),
                           convert_to_numpy=True, batch_size=4)
    activation = _activation(entry, int(model.config.num_labels))
    return ({"scores": _activated(np.asarray(logits), activation)},
            f"{_version('sentence-transformers')} CrossEncoder.predict + {activation}")


def _pipeline(task: str, entry: ModelEntry, folder: Path, **kwargs: Any) -> Any:
    """A transformers pipeline whose tokenizer truncates at the entry's limit."""
    from transformers import AutoConfig, AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    tokenizer.model_max_length = _limit(tokenizer, config, entry.max_seq_length)
    return pipeline(task, model=str(folder), tokenizer=tokenizer, device="cpu",
                    dtype="float32", **kwargs)


def _reference_classify(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    classifier = _pipeline("text-classification", entry, folder, top_k=None)
    labels = [str(classifier.model.config.id2label[i])
              for i in range(int(classifier.model.config.num_labels))]
    rows = classifier(list(probes.TEXTS), truncation=True, batch_size=1)
    return ({"labels": labels, "scores": _label_scores(rows, labels)},
            f"{_version('transformers')} pipeline('text-classification', top_k=None)")


def _reference_zero_shot(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    from tasks.schema import DEFAULT_HYPOTHESIS

    classifier = _pipeline("zero-shot-classification", entry, folder)
    labels = list(probes.ZERO_SHOT_LABELS)
    answers = classifier(list(probes.TEXTS), candidate_labels=labels,
                         hypothesis_template=DEFAULT_HYPOTHESIS, multi_label=False)
    rows = [[{"label": label, "score": score} for label, score in
             zip(a["labels"], a["scores"], strict=True)] for a in answers]
    return ({"labels": labels, "scores": _label_scores(rows, labels)},
            f"{_version('transformers')} pipeline('zero-shot-classification', "
            f"hypothesis_template={DEFAULT_HYPOTHESIS!r})")


def _reference_extract(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    strategy = _aggregation(entry)
    tagger = _pipeline("token-classification", entry, folder, aggregation_strategy=strategy)
    key = "entity" if strategy == "none" else "entity_group"
    spans = [[(int(e["start"]), int(e["end"]), str(e[key]), float(e["score"]))
              for e in tagger(text)] for text in probes.TEXTS]
    return ({"spans": spans}, f"{_version('transformers')} pipeline('token-classification', "
            f"aggregation_strategy={strategy!r})")


def _image_processor(folder: Path) -> Any:
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
        return getattr(processor, "image_processor", processor)
    except (OSError, ValueError, TypeError):  # no processor config: the image one alone
        return AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)


def _features(output: Any) -> Any:
    # transformers 5 returns an output whose pooler_output is the projected vector.
    return output if hasattr(output, "numpy") else output.pooler_output


def _reference_clip(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(folder), local_files_only=True,
                                      dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    processor = _image_processor(folder)
    limit = _limit(tokenizer, model.config.text_config, entry.max_seq_length)
    # SigLIP was trained on texts padded to full length, as its model card says to pad.
    padding = "max_length" if "siglip" in model.config.model_type else True
    out: Outputs = {}
    with torch.inference_mode():
        for kind in prompt_kinds(entry):
            texts = [_prompt(entry, kind) + t for t in probes.TEXTS]
            inputs = tokenizer(texts, padding=padding, truncation=True, max_length=limit,
                               return_tensors="pt", return_token_type_ids=False)
            out[kind] = _features(model.get_text_features(**inputs)).float().numpy()
        pixels = processor(images=probes.probe_images(), return_tensors="pt")["pixel_values"]
        out["image"] = _features(model.get_image_features(pixel_values=pixels)).float().numpy()
    if entry.normalize is not False:  # CLIP vectors are compared by cosine: unit length
        out = {k: v / np.linalg.norm(v, axis=1, keepdims=True) for k, v in out.items()}
    return out, (f"{_version('transformers')} {type(model).__name__}.get_text_features/"
                 f"get_image_features + {type(processor).__name__}")


def _completion_ids(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's ids as the text-generation pipeline makes them, with the BOS token
    where the tokenizer puts one before the text, but without the end tokens a tokenizer
    appends (they would tell the model the text is over) or other special tokens (a BERT
    tokenizer's [CLS] is no BOS)."""
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = tokenizer(text)["input_ids"]
    start = next((k for k in range(len(full) - len(plain) + 1)
                  if full[k : k + len(plain)] == plain), 0)
    bos = tokenizer.bos_token_id
    return [t for t in full[:start] if bos is not None and t == bos] + plain


def _reference_generate(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                 dtype=torch.float32).eval()
    eos = {i for i in (model.generation_config.eos_token_id, tokenizer.eos_token_id)
           for i in (i if isinstance(i, list) else [i]) if isinstance(i, int)}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    # Plain greedy decoding: the files' repetition penalties and the like are not applied,
    # as shoal applies only the request's options.
    greedy = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                              eos_token_id=sorted(eos) or None, pad_token_id=pad)
    texts = []
    for item in generation_items(bool(tokenizer.chat_template)):
        if "text" in item:
            ids = _completion_ids(tokenizer, item["text"])
        else:
            rendered = tokenizer.apply_chat_template(item["messages"], tokenize=False,
                                                     add_generation_prompt=True)
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), generation_config=greedy)
        new = out[0, len(ids):].tolist()
        cut = next((k for k, t in enumerate(new) if t in eos), len(new))
        texts.append(tokenizer.decode(new[:cut], skip_special_tokens=True))
    return {"texts": texts}, (f"{_version('transformers')} AutoModelForCausalLM.generate "
                              f"(greedy, {NEW_TOKENS} tokens, chat template)")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _linear(path: Path) -> tuple[np.ndarray, np.ndarray | None] | None:
    from safetensors.numpy import load_file

    if not path.is_file():
        return None
    tensors = load_file(str(path))
    if "linear.weight" not in tensors:
        return None
    return tensors["linear.weight"].astype(np.float32), tensors.get("linear.bias")


def _colbert_layout(folder: Path) -> tuple[Path, list[tuple[np.ndarray, np.ndarray | None]]]:
    """(the encoder's folder, the projection layers) from the model's files; safetensors
    only (a pickled projection is not read here)."""
    modules_file = folder / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    encoder, layers = folder, []
    for module in modules:
        kind, path = module.get("type", ""), module.get("path", "")
        if kind.endswith("Transformer"):
            encoder = folder / path
        elif kind.endswith(".Dense"):
            layer = _linear(folder / path / "model.safetensors")
            if layer is None:
                return encoder, []
            layers.append(layer)
    if not layers:  # the Stanford layout: linear.weight beside the encoder's weights
        layer = _linear(folder / "model.safetensors")
        layers = [layer] if layer is not None else []
    return encoder, layers


def _reference_multivector(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    """ColBERT document vectors by hand: the encoder's token states through the saved
    linear projection, each L2-normalised. Queries (padded with [MASK] to a fixed length)
    are not probed: no library computes them the same way for every checkpoint layout."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    encoder, layers = _colbert_layout(folder)
    if not layers:
        return {}, ""
    tokenizer = AutoTokenizer.from_pretrained(str(encoder), local_files_only=True)
    model = AutoModel.from_pretrained(str(encoder), local_files_only=True,
                                      dtype=torch.float32).eval()
    st = _read_json(encoder / "sentence_bert_config.json")
    saved = (_read_json(folder / "config_sentence_transformers.json").get("document_length")
             or _read_json(folder / "artifact.metadata").get("doc_maxlen")
             or st.get("max_seq_length"))
    limit = _limit(tokenizer, model.config, entry.max_seq_length or saved)
    rows = []
    for text in probes.TEXTS:
        text = entry.prompts.document + text
        inputs = tokenizer(text.lower() if st.get("do_lower_case") else text,
                           truncation=True, max_length=limit, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**inputs).last_hidden_state[0].numpy()
        for weight, bias in layers:
            hidden = hidden @ weight.T + (bias if bias is not None else 0)
        rows.append(hidden / np.linalg.norm(hidden, axis=1, keepdims=True))
    return {"document": rows}, (f"{_version('transformers')} AutoModel + the saved linear "
                                "projection, per token L2-normalised (by hand, documents)")


_REFERENCES: dict[str, Callable[[ModelEntry, Path], tuple[Outputs, str]]] = {
    "dense": _reference_dense,
    "sparse": _reference_sparse,
    "clip": _reference_clip,
    "multivector": _reference_multivector,
    "cross-encoder": _reference_cross_encoder,
    "sequence-classification": _reference_classify,
    "zero-shot": _reference_zero_shot,
    "token-classification": _reference_extract,
    "causal-lm": _reference_generate,
}


def reference_outputs(entry: ModelEntry, folder: Path) -> Reference:
    """The reference library's outputs on the probes, as the entry's settings ask (fp32,
    CPU)."""
    if entry.adapter not in _REFERENCES:
        raise ValueError(f"no reference library for adapter {entry.adapter!r}")
    outputs, library = _REFERENCES[entry.adapter](entry, Path(folder))
    note = "" if library else f"no reference library for {entry.adapter} (no safetensors " \
        "projection to compute one from)"
    return Reference(entry.adapter, library, outputs, settings_key(entry), note)


# --- comparing -------------------------------------------------------------------------------


def _figures_vectors(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    return _vector_figures(ref, ours, prompt_kinds(entry), _text_names)


def _figures_clip(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    def names(key: str) -> list[str]:
        if key == "image":
            return [f"image {i} ({w}x{h})" for i, (w, h) in enumerate(probes.IMAGE_SIZES)]
        return _text_names(key)

    return _vector_figures(ref, ours, [*prompt_kinds(entry), "image"], names)


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
            where.append(_text_probe(i, "" if kind == "document" else kind))
    mean = float(np.mean(overlaps))
    figures["top10_overlap"] = (mean, _low(overlaps, where)[1])
    return figures


def _figures_multivector(entry: ModelEntry, ref: Outputs, ours: Outputs,
                         slack: float) -> Figures:
    cosines, lengths, where = [], [], []
    for i, (mine, theirs) in enumerate(zip(ours["document"], ref["document"], strict=True)):
        same = mine.shape == theirs.shape
        lengths.append(1.0 if same else 0.0)
        cosines.append(float(_cosines(mine, theirs).min()) if same else -1.0)
        where.append(_text_probe(i) + ("" if same else
                                       f" ({len(mine)} token vectors, expected {len(theirs)})"))
    agree = float(np.mean(lengths))
    return {"cosine_min": _low(cosines, where),
            "cosine_mean": (float(np.mean([c for c in cosines if c > -1] or [0.0])), ""),
            "lengths_agree": (agree, _low(lengths, where)[1])}


def _ranks_agree(mine: np.ndarray, theirs: np.ndarray, slack: float) -> bool:
    """Every two documents in the reference's order, unless it scores them within `slack`."""
    return all(mine[a] > mine[b] for a in range(len(theirs)) for b in range(len(theirs))
               if theirs[a] - theirs[b] > slack)


def _figures_score(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    diffs = np.abs(ours["scores"] - ref["scores"])
    names = [f"pair {i} ({_short(q, 20)}, {_short(d, 20)})"
             for i, (q, d) in enumerate(probes.PAIRS)]
    agree, where, start = [], [], 0
    for q, (query, documents) in enumerate(probes.QUERY_DOCUMENTS):
        span = slice(start, start + len(documents))
        same = _ranks_agree(ours["scores"][span], ref["scores"][span], slack)
        agree.append(1.0 if same else 0.0)
        where.append(f"query {q} {_short(query)}")
        start += len(documents)
    return {"score_max_abs_diff": _high(diffs.tolist(), names),
            "rank_agree": (float(np.mean(agree)), _low(agree, where)[1])}


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
    where = [_text_probe(i) + f" (top {labels[int(np.nanargmax(mine[i]))]!r}, expected "
             f"{labels[int(np.nanargmax(theirs[i]))]!r})" for i in range(len(mine))]
    diffs = np.nan_to_num(np.abs(mine - theirs), nan=1.0).max(axis=1)
    return {"labels_agree": (float(same.mean()), _low(same.tolist(), where)[1]),
            "score_max_abs_diff": _high(diffs.tolist(), [_text_probe(i)
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
        where.append(_text_probe(i) + (f" (span {missing[0]} on one side only)"
                                       if missing else ""))
    return {"spans_agree": (float(np.mean(agree)), _low(agree, where)[1]),
            "score_max_abs_diff": _high(diffs, where)}


def _figures_texts(entry: ModelEntry, ref: Outputs, ours: Outputs, slack: float) -> Figures:
    items = generation_items(len(ref["texts"]) > len(probes.COMPLETION_PROMPTS))
    agree, where = [], []
    for i, (mine, theirs, item) in enumerate(zip(ours["texts"], ref["texts"], items,
                                                 strict=True)):
        agree.append(1.0 if mine == theirs else 0.0)
        prompt = item.get("text") or item["messages"][-1]["content"]
        where.append(f"prompt {i} {_short(prompt)} (got {_short(mine, 24)}, expected "
                     f"{_short(theirs, 24)})")
    return {"tokens_agree": (float(np.mean(agree)), _low(agree, where)[1])}


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


def check_parity(entry: ModelEntry, folder: Path, engine: str = "pytorch",
                 precision: str = "fp32",
                 reference: Reference | None = None) -> tuple[ParityResult, Reference]:
    """Shoal on `engine` at `precision` against the reference (computed now unless one for
    the same entry settings is given): the result and the reference, to pass to the next
    call."""
    if reference is None or reference.settings != settings_key(entry):
        reference = reference_outputs(entry, Path(folder))
    try:
        ours = shoal_outputs(entry, engine, precision)
    except ShoalRefused as exc:
        bounds = tolerance_of(entry.adapter, precision)
        return ParityResult({}, False, stated(bounds), str(exc), reference.library), reference
    return compare(entry, reference, ours, precision), reference

