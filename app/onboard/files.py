"""A model folder's own files, read and checked before anything runs.

`ModelFiles.open(folder)` reads the JSON files that say what a model is (config.json,
the sentence-transformers files, tokenizer and generation configs, a processor config)
and refuses, with a one-line reason, what onboarding cannot serve: a folder that is not a
model, weights that are cut short, an architecture transformers does not know, a model
that needs remote code. Only JSON is read here; the weights are opened by their libraries
later, and of a safetensors file only its JSON header is read, to check its length.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class OnboardError(Exception):
    """Input onboarding cannot use; the message is one line saying what to fix."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OnboardError(f"{path.name} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OnboardError(f"{path.name} is not a JSON object")
    return data


def optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def check_safetensors(path: Path) -> None:
    """Raise OnboardError if the file is shorter than its own header says (a cut-off
    download or copy), or its header is not a safetensors header."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise OnboardError(f"{path.name} is truncated ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise OnboardError(f"{path.name} is truncated: its header alone needs "
                               f"{header_len + 8} bytes, the file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise OnboardError(f"{path.name} is not a safetensors file (its header is not "
                               "JSON)") from None
    ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        raise OnboardError(f"{path.name} is truncated: its header describes {needed} bytes, "
                           f"the file has {size} (download or copy it again)")


def tensor_shape(path: Path, name: str) -> list[int] | None:
    """A tensor's shape from a safetensors header, without reading the tensor."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    tensor = header.get(name)
    return list(tensor["shape"]) if tensor else None


@dataclass
class ModelFiles:
    """What a model folder's files say, read once."""

    folder: Path
    config: dict[str, Any]
    modules: list[dict[str, Any]] = field(default_factory=list)  # modules.json
    st_config: dict[str, Any] = field(default_factory=dict)  # config_sentence_transformers.json
    bert_config: dict[str, Any] = field(default_factory=dict)  # sentence_bert_config.json
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    processor_config: dict[str, Any] = field(default_factory=dict)  # preprocessor_config.json
    weights: list[Path] = field(default_factory=list)

    @classmethod
    def open(cls, folder: Path) -> ModelFiles:
        if not folder.is_dir():
            raise OnboardError(f"{folder} is not a folder")
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise OnboardError(f"{folder} is not a model folder: it has no config.json "
                               "(a transformers model saved with save_pretrained has one)")
        config = read_json(config_path)
        if "model_type" not in config and "architectures" not in config:
            raise OnboardError(f"{folder}/config.json names no model_type or architectures: "
                               "not a transformers model config")
        modules_path = folder / "modules.json"
        try:
            modules = json.loads(modules_path.read_text()) if modules_path.is_file() else []
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise OnboardError(f"modules.json cannot be read as JSON: {exc}") from None
        files = cls(
            folder=folder, config=config, modules=modules if isinstance(modules, list) else [],
            st_config=optional_json(folder / "config_sentence_transformers.json"),
            bert_config=optional_json(folder / "sentence_bert_config.json"),
            tokenizer_config=optional_json(folder / "tokenizer_config.json"),
            generation_config=optional_json(folder / "generation_config.json"),
            processor_config=optional_json(folder / "preprocessor_config.json"),
            weights=sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern)}),
        )
        files._check()
        return files

    def _check(self) -> None:
        auto_map = self.config.get("auto_map") or self.tokenizer_config.get("auto_map")
        if auto_map:
            code = sorted({str(v) for v in auto_map.values()})
            raise OnboardError(f"{self.folder.name} needs remote code ({', '.join(code)} in "
                               "auto_map): shoal runs only the architectures transformers "
                               "ships, never a model's own Python files")
        if not self.weights:
            raise OnboardError(f"{self.folder} has no weights (*.safetensors or "
                               "pytorch_model.bin)")
        for path in self.weights:
            if path.suffix == ".safetensors":
                check_safetensors(path)
        self._check_architecture()

    def _check_architecture(self) -> None:
        from transformers import CONFIG_MAPPING

        model_type = self.config.get("model_type")
        if model_type not in CONFIG_MAPPING:
            import transformers

            raise OnboardError(f"unknown architecture {self.architecture or '?'} (model_type "
                               f"{model_type!r}): transformers {transformers.__version__} "
                               "does not know it")

    @property
    def architecture(self) -> str:
        names = self.config.get("architectures") or []
        return str(names[0]) if names else ""

    def module(self, suffix: str) -> dict[str, Any] | None:
        """The first sentence-transformers module whose type ends with `suffix`."""
        return next((m for m in self.modules if str(m.get("type", "")).endswith(suffix)), None)

    def module_config(self, module: dict[str, Any]) -> dict[str, Any]:
        return optional_json(self.folder / module.get("path", "") / "config.json")

    def has_chat_template(self) -> bool:
        return bool(self.tokenizer_config.get("chat_template")) or any(
            (self.folder / name).is_file() for name in ("chat_template.jinja",
                                                         "chat_template.json"))
