"""The bounds each family's parity figures are held to, per precision class."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


REDUCED = ("bf16", "fp16", "int8")


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
