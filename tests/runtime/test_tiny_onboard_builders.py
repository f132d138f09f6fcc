"""The tiny_onboard builders: each folder loads through its own library, each bad one is
bad the way its name says, and the CLS-trained model really pairs paraphrases only with CLS."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    BertModel,
    GenerationConfig,
)

from tests.tiny_onboard import (
    PARAPHRASE_PAIRS,
    build_causal_lm_with_generation_config,
    build_cls_trained_saved_as_mean,
    build_not_a_model,
    build_remote_code,
    build_st_cross_encoder,
    build_st_dense,
    build_st_sparse,
    build_truncated_weights,
    build_unknown_architecture,
    pairing_accuracy,
    pooled_embedder,
)

PROMPTS = {"query": "query: ", "document": "passage: "}


@pytest.mark.parametrize(("pooling", "normalize", "prompts", "dense_dims"), [
    ("mean", True, None, None),
    ("cls", False, PROMPTS, 16),
    ("lasttoken", True, PROMPTS, None),
])
def test_st_dense(tmp_path: Path, pooling: str, normalize: bool,
                  prompts: dict[str, str] | None, dense_dims: int | None) -> None:
    out = build_st_dense(tmp_path / "m", pooling=pooling, normalize=normalize,
                         prompts=prompts, dense_dims=dense_dims, max_seq_length=48)
    assert out == tmp_path / "m"
    saved = json.loads((out / "config_sentence_transformers.json").read_text())
    # With no prompts given, sentence-transformers 6 still writes empty query/document ones.
    assert saved["prompts"] == (prompts or {"query": "", "document": ""})
    pooling_config = json.loads((out / "1_Pooling" / "config.json").read_text())
    assert pooling_config["pooling_mode"] == pooling
    assert (out / "2_Dense").is_dir() == (dense_dims is not None)
    model = SentenceTransformer(str(out), device="cpu")
    assert model.max_seq_length == 48
    name = "query" if prompts else None
    embeddings = model.encode(["a text", "another one"], prompt_name=name)
    assert embeddings.shape == (2, dense_dims or 32)
    norms = np.linalg.norm(embeddings, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize


def test_st_dense_is_deterministic(tmp_path: Path) -> None:
    a = build_st_dense(tmp_path / "a", seed=3, dense_dims=8)
    b = build_st_dense(tmp_path / "b", seed=3, dense_dims=8)
    for part in ("model.safetensors", "2_Dense/model.safetensors"):
        assert (a / part).read_bytes() == (b / part).read_bytes()


@pytest.mark.parametrize("num_labels", [1, 3])
def test_st_cross_encoder(tmp_path: Path, num_labels: int) -> None:
    out = build_st_cross_encoder(tmp_path / "ce", num_labels=num_labels)
    saved = json.loads((out / "config_sentence_transformers.json").read_text())
    assert saved["model_type"] == "CrossEncoder"
    scores = CrossEncoder(str(out), device="cpu").predict([("q", "d"), ("a query", "a doc")])
    assert np.asarray(scores).shape == ((2,) if num_labels == 1 else (2, num_labels))


@pytest.mark.parametrize("legacy_mlm", [True, False])
def test_st_sparse(tmp_path: Path, legacy_mlm: bool) -> None:
    out = build_st_sparse(tmp_path / "sp", legacy_mlm=legacy_mlm)
    root = json.loads((out / "modules.json").read_text())[0]["type"]
    assert root.endswith("MLMTransformer" if legacy_mlm else ".Transformer")
    vector = SparseEncoder(str(out), device="cpu").encode(["a text"])
    terms = vector.coalesce().values().numel()
    assert 0 < terms < vector.shape[1] // 10  # sparse, like a trained SPLADE


def test_cls_trained_saved_as_mean(tmp_path: Path) -> None:
    out = build_cls_trained_saved_as_mean(tmp_path / "m", PARAPHRASE_PAIRS)
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    claimed = SentenceTransformer(str(out), device="cpu")
    assert pairing_accuracy(pooled_embedder(out, "cls"), PARAPHRASE_PAIRS) >= 0.9
    assert pairing_accuracy(pooled_embedder(out, "mean"), PARAPHRASE_PAIRS) <= 0.5
    assert pairing_accuracy(claimed.encode, PARAPHRASE_PAIRS) <= 0.5
    texts = [a for a, _ in PARAPHRASE_PAIRS[:3]]
    mean = pooled_embedder(out, "mean")(texts)
    mean /= np.linalg.norm(mean, axis=1, keepdims=True)
    np.testing.assert_allclose(claimed.encode(texts), mean, atol=1e-5)


def test_pairing_accuracy() -> None:
    pairs = [("a", "x"), ("b", "y"), ("c", "z")]
    table = {"a": [1, 0], "b": [0, 1], "c": [-1, 0], "x": [1, 0.1], "y": [0, 1], "z": [0.1, 1]}

    def embed(texts: list[str]) -> np.ndarray:
        return np.array([table[t] for t in texts], dtype=float)

    assert pairing_accuracy(embed, pairs) == pytest.approx(2 / 3)


def test_not_a_model(tmp_path: Path) -> None:
    out = build_not_a_model(tmp_path / "x")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "data.csv"]
    with pytest.raises((OSError, ValueError)):
        AutoConfig.from_pretrained(str(out))


def test_truncated_weights(tmp_path: Path) -> None:
    out = build_truncated_weights(tmp_path / "t")
    assert AutoConfig.from_pretrained(str(out)).model_type == "bert"
    AutoTokenizer.from_pretrained(str(out))
    with pytest.raises((SafetensorError, OSError)):
        AutoModel.from_pretrained(str(out))


def test_unknown_architecture(tmp_path: Path) -> None:
    out = build_unknown_architecture(tmp_path / "u")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["FrobnicatorModel"]
    assert (out / "model.safetensors").stat().st_size < 64 * 1024
    AutoTokenizer.from_pretrained(str(out))
    with pytest.raises(ValueError, match="frobnicator"):
        AutoConfig.from_pretrained(str(out))


def test_remote_code(tmp_path: Path) -> None:
    out = build_remote_code(tmp_path / "r")
    config = AutoConfig.from_pretrained(str(out))
    assert config.auto_map == {"AutoModel": "modeling_custom.CustomModel"}
    # Without trust_remote_code transformers silently falls back to its own BERT class.
    assert type(AutoModel.from_pretrained(str(out))) is BertModel
    # The shipped code is real: load it from its file (not through the hub module cache).
    spec = importlib.util.spec_from_file_location("modeling_custom", out / "modeling_custom.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert type(module.CustomModel.from_pretrained(str(out))).__name__ == "CustomModel"


def test_causal_lm_with_generation_config(tmp_path: Path) -> None:
    out = build_causal_lm_with_generation_config(tmp_path / "lm")
    generation = GenerationConfig.from_pretrained(str(out))
    assert generation.max_new_tokens == 16
    assert generation.do_sample is False
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert generation.eos_token_id == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<assistant> ")
    model = AutoModelForCausalLM.from_pretrained(str(out))
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False,
                    return_token_type_ids=False)
    with torch.no_grad():
        generated = model.generate(**ids, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] - ids["input_ids"].shape[1] <= 16
