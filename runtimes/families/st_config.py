"""Read pooling, normalisation and length from sentence-transformers files.

A sentence-transformers model directory carries `modules.json` (the module
pipeline), a pooling config and `sentence_bert_config.json`; reading them
lets shoal reproduce `SentenceTransformer.encode` without importing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class SentenceTransformerConfig:
    pooling: str | None = None
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False


def pooling_mode(config: dict, model_dir: Path) -> str:
    """The single pooling mode of a Pooling config (v6 `pooling_mode` or older flags)."""
    if "pooling_mode" in config:  # sentence-transformers >= 6
        mode = config["pooling_mode"]
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    chosen = [_POOLING_MODES.get(m, m) for m in modes]
    supported = set(_POOLING_MODES.values())
    if len(chosen) != 1 or chosen[0] not in supported:
        raise ValueError(
            f"{model_dir}: pooling {modes} is not supported; "
            f"shoal supports exactly one of {sorted(supported)}"
        )
    return chosen[0]


def read_st_config(model_dir: Path) -> SentenceTransformerConfig:
    """What the directory's sentence-transformers files say (defaults if absent)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return SentenceTransformerConfig()
    modules = json.loads(modules_file.read_text())
    pooling = None
    normalize = False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith(".Pooling"):
            config = json.loads((model_dir / module["path"] / "config.json").read_text())
            pooling = pooling_mode(config, model_dir)
        elif kind.endswith(".Normalize"):
            normalize = True
    bert_config_file = model_dir / "sentence_bert_config.json"
    bert_config = json.loads(bert_config_file.read_text()) if bert_config_file.is_file() else {}
    return SentenceTransformerConfig(
        pooling=pooling,
        normalize=normalize,
        max_seq_length=bert_config.get("max_seq_length"),
        do_lower_case=bool(bert_config.get("do_lower_case", False)),
    )
