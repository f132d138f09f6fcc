"""Onboarding's parity check (`app.onboard.parity`): every family's tiny model passes
against its reference library in fp32 on PyTorch, dense also on ONNX Runtime (fp32, and
int8 within the looser tolerance), and a wrong setting fails with the figure that shows it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from app.onboard import probes
from app.onboard.parity import (
    TOLERANCES,
    Reference,
    check_parity,
    compare,
    precision_class,
    reference_outputs,
    settings_key,
    shoal_outputs,
)
from tasks.catalog import ModelEntry
from tests.stack import REPO
from tests.tiny_classifiers import (
    build_tiny_cross_encoder,
    build_tiny_ner,
    build_tiny_nli,
    build_tiny_sentiment,
)
from tests.tiny_clip import PROJECTION_DIM, build_tiny_clip
from tests.tiny_encoders import build_tiny_colbert_st, build_tiny_splade
from tests.tiny_lm import build_tiny_llama
from tests.tiny_models import MINILM_DIR, build_tiny_bert, build_tiny_sentence_transformer
from tests.tiny_onboard import build_st_cross_encoder, build_st_dense, build_st_sparse

PROMPTS = {"query": "query: ", "document": "passage: "}
# name -> (builder, the entry's settings beyond id and source)
FAMILIES: dict[str, tuple[Callable[[Path], Path], dict[str, Any]]] = {
    "dense": (lambda out: build_tiny_sentence_transformer(out, "mean", True),
              {"adapter": "dense", "dims": 32}),
    "dense-prompts": (lambda out: build_st_dense(out, normalize=False, prompts=PROMPTS),
                      {"adapter": "dense", "dims": 32, "max_seq_length": 32,
                       "prompts": PROMPTS}),
    # 512 from the tokenizer's files, over the model's 128 positions: both sides cap it.
    "dense-plain": (build_tiny_bert, {"adapter": "dense", "dims": 32, "pooling": "mean",
                                      "normalize": True, "max_seq_length": 512}),
    "sparse": (build_tiny_splade, {"adapter": "sparse"}),  # SPLADE by hand: no ST files
    "sparse-st": (build_st_sparse, {"adapter": "sparse"}),
    "cross-encoder": (build_tiny_cross_encoder, {"adapter": "cross-encoder"}),
    "cross-encoder-st": (lambda out: build_st_cross_encoder(out, num_labels=3),
                         {"adapter": "cross-encoder"}),
    "sequence-classification": (build_tiny_sentiment, {"adapter": "sequence-classification"}),
    "zero-shot": (build_tiny_nli, {"adapter": "zero-shot"}),
    "token-classification": (build_tiny_ner, {"adapter": "token-classification"}),
    "clip": (build_tiny_clip, {"adapter": "clip", "dims": PROJECTION_DIM}),
    "causal-lm": (build_tiny_llama, {"adapter": "causal-lm"}),
    "multivector": (build_tiny_colbert_st, {"adapter": "multivector", "dims": 16}),
}


@pytest.fixture(scope="module", autouse=True)
def onnx_cache(tmp_path_factory: pytest.TempPathFactory):
    patch = pytest.MonkeyPatch()
    patch.setenv("SHOAL_ONNX_CACHE", str(tmp_path_factory.mktemp("onnx-cache")))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity")
    return {name: build(root / name) for name, (build, _) in FAMILIES.items()}


def entry_of(name: str, folder: Path, **settings: Any) -> ModelEntry:
    return ModelEntry.model_validate({"id": f"test/parity-{name}",
                                      "source": {"path": str(folder)},
                                      **FAMILIES[name][1], **settings})


@pytest.fixture(scope="module")
def dense_reference(folders: dict[str, Path]) -> Reference:
    return reference_outputs(entry_of("dense", folders["dense"]), folders["dense"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_passes_in_fp32_on_pytorch(folders: dict[str, Path], name: str) -> None:
    entry = entry_of(name, folders[name])
    result, reference = check_parity(entry, folders[name])
    assert result.ok, result.detail
    assert result.detail == "" and result.library and reference.library == result.library
    assert set(result.figures) >= set(TOLERANCES[entry.adapter]["fp32"])
    assert result.tolerance == ", ".join(
        f"{figure} {op} {bound:g}" for figure, (op, bound) in
        TOLERANCES[entry.adapter]["fp32"].items())


def test_prompts_probe_queries_and_documents(folders: dict[str, Path]) -> None:
    entry = entry_of("dense-prompts", folders["dense-prompts"])
    reference = reference_outputs(entry, folders["dense-prompts"])
    assert set(reference.outputs) == {"query", "document"}
    assert reference.outputs["query"].shape == (len(probes.TEXTS), 32)
    # Encoded without its prompt, the query side fails where the prompt matters most.
    unprompted = entry_of("dense-prompts", folders["dense-prompts"],
                          prompts={"query": "", "document": "passage: "})
    result = compare(entry, reference, shoal_outputs(unprompted), "fp32")
    assert not result.ok and result.detail.startswith("cosine_min")
    assert "query text" in result.detail


def test_dense_on_onnx_fp32_and_int8(folders: dict[str, Path],
                                     dense_reference: Reference) -> None:
    entry = entry_of("dense", folders["dense"])
    fp32, reused = check_parity(entry, folders["dense"], "onnx", "fp32", dense_reference)
    assert reused is dense_reference  # the same settings: computed once
    assert fp32.ok and fp32.figures["cosine_min"] >= 0.999, fp32.detail
    int8, _ = check_parity(entry, folders["dense"], "onnx", "int8", dense_reference)
    assert int8.ok, int8.detail
    loose = TOLERANCES["dense"]["reduced"]["cosine_min"][1]
    assert int8.tolerance.startswith(f"cosine_min >= {loose:g}") and loose < 0.999


def test_wrong_pooling_fails_on_cosine(folders: dict[str, Path],
                                       dense_reference: Reference) -> None:
    wrong = entry_of("dense", folders["dense"], pooling="cls")
    result = compare(wrong, dense_reference, shoal_outputs(wrong), "fp32")
    assert not result.ok and result.figures["cosine_min"] < 0.99
    assert result.detail.startswith("cosine_min ") and "needs >= 0.999" in result.detail
    assert "worst at text " in result.detail and "\n" not in result.detail


def test_flipped_normalisation_fails_on_norms(folders: dict[str, Path],
                                              dense_reference: Reference) -> None:
    wrong = entry_of("dense", folders["dense"], normalize=False)
    result = compare(wrong, dense_reference, shoal_outputs(wrong), "fp32")
    # A cosine cannot see a vector's length: the norms figure does.
    assert result.figures["cosine_min"] >= 0.999
    assert not result.ok and result.detail.startswith("norm_max_rel_diff ")


def test_a_dense_module_shoal_does_not_apply_fails(tmp_path: Path) -> None:
    """sentence-transformers projects the pooled vector through the folder's Dense module;
    shoal's dense adapter serves the pooled vector as it is, so parity refuses the model."""
    folder = build_st_dense(tmp_path / "dense16", dense_dims=16)
    entry = ModelEntry.model_validate({"id": "test/parity-dense16", "adapter": "dense",
                                       "dims": 16, "source": {"path": str(folder)}})
    result, _ = check_parity(entry, folder)
    assert not result.ok and result.detail.startswith("cosine_min 0 ")
    assert "shoal gives 32 dims, the reference 16" in result.detail


def test_another_pooling_choice_gets_its_own_reference(folders: dict[str, Path],
                                                       dense_reference: Reference) -> None:
    """Without a reference, the user's choice is checked against sentence-transformers
    with that choice (the same modules, another Pooling); held to the files' reference
    (onboarding's search among alternatives), the same choice fails."""
    chosen = entry_of("dense", folders["dense"], pooling="cls", normalize=False)
    result, reference = check_parity(chosen, folders["dense"])
    assert reference.settings == settings_key(chosen)
    assert "rebuilt with Pooling(cls)" in reference.library
    assert result.ok, result.detail
    against_files, kept = check_parity(chosen, folders["dense"], reference=dense_reference)
    assert kept is dense_reference and not against_files.ok


def test_a_family_without_a_reference_says_so() -> None:
    entry = ModelEntry.model_validate({"id": "test/colbert-bin", "adapter": "multivector",
                                       "dims": 16, "source": {"path": "/nowhere"}})
    note = "no reference library for multivector (no safetensors projection)"
    result = compare(entry, Reference("multivector", "", {}, settings_key(entry), note), {},
                     "fp32")
    assert result.ok and result.figures == {} and result.detail == note


def test_probes_are_fixed_and_long_enough() -> None:
    images = probes.probe_images()
    assert [image.size for image in images] == list(probes.IMAGE_SIZES)
    assert all(image.mode == "RGB" for image in images)
    assert [probes.png_bytes(i) for i in images] == \
        [probes.png_bytes(i) for i in probes.probe_images()]
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    assert len(tokenizer(probes.LONG_TEXT)["input_ids"]) > 256  # truncated by MiniLM too
    assert len(probes.PAIRS) == sum(len(docs) for _, docs in probes.QUERY_DOCUMENTS)


def test_the_table_covers_every_family_and_precision() -> None:
    assert {precision_class(p) for p in ("bf16", "fp16", "int8")} == {"reduced"}
    assert precision_class("fp32") == "fp32"
    for family, classes in TOLERANCES.items():
        assert set(classes) == {"fp32", "reduced"}, family
        for figure, (op, bound) in classes["reduced"].items():
            strict = classes["fp32"][figure][1]
            assert (bound <= strict) if op == ">=" else (bound >= strict), (family, figure)


def test_importing_parity_loads_no_model_library() -> None:
    code = ("import sys, app.onboard.parity; "
            "print(sorted({'torch', 'transformers', 'sentence_transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
