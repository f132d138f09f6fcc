"""Tiny models saved the way their own ecosystem saves them, for `shoal onboard`'s tests.

`shoal onboard` reads a model folder's own files, detects the model family and
proves parity against the model's reference library, so these folders are
written by that library itself (sentence-transformers' `save`, transformers'
`save_pretrained`), not assembled by hand: what onboard must read is exactly
what a user's folder holds. They reuse the tiny builders of `tests.tiny_models`,
`tests.tiny_classifiers`, `tests.tiny_encoders` and `tests.tiny_lm` (hidden 32,
2 layers, the MiniLM tokenizer, nothing downloaded) and add what those lack:

* sentence-transformers dense (pooling, Dense, Normalize, prompts), cross-encoder
  and sparse (SPLADE) folders as `SentenceTransformer` / `CrossEncoder` /
  `SparseEncoder` save them;
* a model trained for CLS pooling whose folder claims mean pooling, so that only
  a parity check on *meaning* (paraphrase pairing) finds the mistake;
* bad folders: not a model, truncated weights, an unknown architecture, and one
  needing `trust_remote_code`;
* a chat causal LM with its own generation defaults.

Notes on sentence-transformers 6 layouts: the maximum sequence length lands in
`tokenizer_config.json` (`model_max_length`), not in `sentence_bert_config.json`;
prompts and the model class (`model_type`) land in
`config_sentence_transformers.json` (with no prompts given, SentenceTransformer and
SparseEncoder still write empty "query" and "document" ones); a saved CrossEncoder is
a sentence-transformers folder too (`modules.json` with one Transformer module, its
activation in `config_sentence_transformers.json`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, GenerationConfig

from tests.tiny_classifiers import build_tiny_cross_encoder
from tests.tiny_encoders import build_tiny_splade
from tests.tiny_lm import build_tiny_llama
from tests.tiny_models import MINILM_DIR, build_tiny_bert

# Paraphrases with (almost) no words in common: only meaning pairs them.
PARAPHRASE_PAIRS: list[tuple[str, str]] = [
    ("the car would not start", "my vehicle failed to turn on"),
    ("it is raining heavily outside", "a storm pours down beyond the window"),
    ("i am extremely hungry", "my stomach craves food badly"),
    ("the movie was boring", "that film put me to sleep"),
    ("he bought a new house", "a fresh home was purchased by him"),
    ("please close the door", "shut that entrance now"),
    ("the price is too high", "this costs far more than reasonable"),
    ("our team won the match", "we defeated every opponent"),
    ("the baby fell asleep", "our infant drifted off to dreamland"),
    ("she speaks three languages", "her fluency covers several tongues"),
    ("the shop opens early", "trading begins at dawn"),
    ("my phone battery died", "the mobile ran out of power"),
]
TRAIN_STEPS = 200
TRAIN_LR = 3e-3
TRAIN_SCALE = 20.0  # inverse temperature of the in-batch contrastive loss

REMOTE_CODE = '''"""Custom modelling code: loading it needs trust_remote_code=True."""

from transformers import BertModel


class CustomModel(BertModel):
    """A BERT under another name, as remote-code checkpoints ship their own classes."""
'''


def build_st_dense(out: Path, pooling: str = "mean", normalize: bool = True,
                   prompts: dict[str, str] | None = None, dense_dims: int | None = None,
                   max_seq_length: int = 64, seed: int = 0) -> Path:
    """A SentenceTransformer folder (Transformer, Pooling, optional Dense and Normalize,
    prompts in config_sentence_transformers.json): the dense family onboard detects."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    with tempfile.TemporaryDirectory() as tmp:
        transformer = Transformer(str(build_tiny_bert(Path(tmp) / "bert", seed=seed)),
                                  max_seq_length=max_seq_length)
        dims = transformer.get_embedding_dimension()
        modules: list[torch.nn.Module] = [transformer, Pooling(dims, pooling_mode=pooling)]
        if dense_dims is not None:
            torch.manual_seed(seed + 1)
            modules.append(Dense(dims, dense_dims))  # sentence-transformers' default: Tanh
        if normalize:
            modules.append(Normalize())
        SentenceTransformer(modules=modules, prompts=prompts, device="cpu").save(str(out))
    return out


def build_st_cross_encoder(out: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A BERT sequence classifier loaded and saved by sentence-transformers' CrossEncoder
    (modules.json, activation in config_sentence_transformers.json): the reranker family."""
    from sentence_transformers import CrossEncoder

    with tempfile.TemporaryDirectory() as tmp:
        plain = build_tiny_cross_encoder(Path(tmp) / "classifier", num_labels, seed=seed)
        CrossEncoder(str(plain), device="cpu").save(str(out))
    return out


def build_st_sparse(out: Path, max_seq_length: int = 64, legacy_mlm: bool = True,
                    seed: int = 0) -> Path:
    """A SPLADE SparseEncoder folder (masked LM at the root + 1_SpladePooling) from a tiny
    masked LM whose negative output bias keeps vectors sparse: the sparse family.

    `legacy_mlm` records the root module as MLMTransformer, as SPLADE checkpoints on the
    hub do (deprecated since sentence-transformers 5.4, which logs a warning); False saves
    what sentence-transformers 6 writes now, a Transformer with transformer_task "fill-mask".
    """
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import (
        MLMTransformer,
        SpladePooling,
        Transformer,
    )

    with tempfile.TemporaryDirectory() as tmp:
        mlm_dir = str(build_tiny_splade(Path(tmp) / "mlm", seed=seed))
        mlm = (MLMTransformer(mlm_dir, max_seq_length=max_seq_length) if legacy_mlm else
               Transformer(mlm_dir, transformer_task="fill-mask", max_seq_length=max_seq_length))
        SparseEncoder(modules=[mlm, SpladePooling("max")], device="cpu").save(str(out))
    return out


def _pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "mean":  # over every real token, [CLS] and [SEP] included, as ST does
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    raise ValueError(f"unknown pooling {pooling!r}")


def build_cls_trained_saved_as_mean(out: Path, pairs: list[tuple[str, str]],
                                    seed: int = 0, steps: int = TRAIN_STEPS) -> Path:
    """A BERT trained so CLS pooling pairs each pair's texts and mean pooling pairs each
    first text with the *next* pair's second, saved claiming mean pooling + Normalize:
    the wrong-pooling folder that only a paraphrase check (not a self-parity one) catches."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=37,
                        max_position_embeddings=128)
    torch.manual_seed(seed)
    model = BertModel(config)
    model.eval()  # no dropout: training is deterministic for the seed
    # The word embeddings stay random: training the 30k-row table makes each step ~3x slower.
    model.embeddings.word_embeddings.weight.requires_grad_(False)
    first = tokenizer([a for a, _ in pairs], padding=True, return_tensors="pt")
    second = tokenizer([b for _, b in pairs], padding=True, return_tensors="pt")
    own = torch.arange(len(pairs))
    shifted = (own + 1) % len(pairs)  # mean pooling is taught to pair i with i + 1
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=TRAIN_LR)

    def embed(batch: dict[str, torch.Tensor], pooling: str) -> torch.Tensor:
        hidden = model(**batch).last_hidden_state
        return F.normalize(_pool(hidden, batch["attention_mask"], pooling), dim=-1)

    # One thread: these tensors are tiny, and two threads beside another busy process
    # (parallel test runs) spin-wait, making training ten times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            cls_scores = embed(first, "cls") @ embed(second, "cls").T * TRAIN_SCALE
            mean_scores = embed(first, "mean") @ embed(second, "mean").T * TRAIN_SCALE
            loss = (F.cross_entropy(cls_scores, own) + F.cross_entropy(cls_scores.T, own)
                    + F.cross_entropy(mean_scores, shifted)
                    + F.cross_entropy(mean_scores.T, (own - 1) % len(pairs)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.embeddings.word_embeddings.weight.requires_grad_(True)

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=64)
        pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
        SentenceTransformer(modules=[transformer, pooling, Normalize()],
                            device="cpu").save(str(out))
    return out


def pooled_embedder(model_dir: Path, pooling: str) -> Callable[[list[str]], np.ndarray]:
    """Embeds texts with the folder's transformer (via transformers, not its modules.json)
    pooled by `pooling` ("cls" or "mean"): the truth to hold a claimed pooling against."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).eval()

    def embed(texts: list[str]) -> np.ndarray:
        batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        return _pool(hidden, batch["attention_mask"], pooling).numpy()

    return embed


def pairing_accuracy(embed: Callable[[list[str]], np.ndarray],
                     pairs: list[tuple[str, str]]) -> float:
    """The fraction of first texts whose most cosine-similar second text is their own pair's."""
    first = np.asarray(embed([a for a, _ in pairs]), dtype=np.float64)
    second = np.asarray(embed([b for _, b in pairs]), dtype=np.float64)
    first /= np.linalg.norm(first, axis=1, keepdims=True)
    second /= np.linalg.norm(second, axis=1, keepdims=True)
    best = (first @ second.T).argmax(axis=1)
    return float((best == np.arange(len(pairs))).mean())


def build_not_a_model(out: Path) -> Path:
    """A folder with only a README.md and a data.csv: onboard must say it is no model."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text("# Quarterly numbers\n\nSales figures, not a model.\n")
    (out / "data.csv").write_text("quarter,sales\nQ1,120\nQ2,135\nQ3,128\n")
    return out


def build_truncated_weights(out: Path, seed: int = 0) -> Path:
    """A valid tiny BERT folder whose model.safetensors is cut to half its bytes (an
    interrupted download): its config reads, loading its weights raises."""
    build_tiny_bert(out, seed=seed)
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return out


def build_unknown_architecture(out: Path, seed: int = 0) -> Path:
    """config.json naming FrobnicatorModel / model_type "frobnicator", the MiniLM tokenizer
    files and a small safetensors file: a family neither onboard nor transformers knows."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    tokenizer.save_pretrained(out)
    config = {"architectures": ["FrobnicatorModel"], "model_type": "frobnicator",
              "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 64}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator().manual_seed(seed)
    save_file({"frobnicator.embed.weight": torch.randn(64, 32, generator=generator),
               "frobnicator.layers.0.weight": torch.randn(32, 32, generator=generator)},
              str(out / "model.safetensors"))
    return out


def build_remote_code(out: Path, seed: int = 0) -> Path:
    """A tiny BERT folder whose config.json maps AutoModel to modeling_custom.CustomModel,
    shipped beside it: a model needing trust_remote_code, which onboard must refuse to run.
    (transformers still loads it as a plain BertModel when trust_remote_code is off.)"""
    build_tiny_bert(out, seed=seed)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoModel": "modeling_custom.CustomModel"}
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out / "modeling_custom.py").write_text(REMOTE_CODE)
    return out


def build_causal_lm_with_generation_config(out: Path, seed: int = 0) -> Path:
    """The tiny chat Llama (chat_template.jinja) with generation defaults of its own
    (max_new_tokens 16, greedy) in generation_config.json, which onboard must honour.
    save_pretrained already writes a generation_config.json, but only the token ids."""
    build_tiny_llama(out, seed=seed, chat_template=True)
    config = json.loads((out / "config.json").read_text())
    GenerationConfig(max_new_tokens=16, do_sample=False, bos_token_id=config["bos_token_id"],
                     eos_token_id=config["eos_token_id"],
                     pad_token_id=config["pad_token_id"]).save_pretrained(out)
    return out
