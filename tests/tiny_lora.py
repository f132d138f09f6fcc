"""Tiny LoRA adapters (peft format) for the tiny models of `tests.tiny_models` and
`tests.tiny_lm`, made at test time, and peft's own merged model as a reference.

peft starts a LoRA's B matrix at zero, which makes a fresh adapter equal to its
base model; these start every factor at random (`init_lora_weights=False`), so a
LoRA changes the output and a test that ignores it fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModel

# The modules a LoRA wraps in each tiny architecture.
BERT_TARGETS = ("query", "key", "value", "dense")
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")


def build_tiny_lora(base: Path, out: Path, *, targets: Sequence[str], seed: int = 0,
                    model_class: Any = AutoModel, rank: int = 4, alpha: int = 16,
                    task_type: str | None = None, fan_in_fan_out: bool = False) -> Path:
    """A LoRA of the model in `base`, saved in `out` the way peft saves one (only the
    adapter: adapter_config.json + adapter_model.safetensors)."""
    model = model_class.from_pretrained(str(base), local_files_only=True)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        init_lora_weights=False, task_type=task_type,
                        fan_in_fan_out=fan_in_fan_out)
    get_peft_model(model, config).save_pretrained(str(out))
    return out


def merged_model(base: Path, lora: Path, model_class: Any = AutoModel) -> Any:
    """A fresh copy of the base model with the LoRA merged into its weights by peft."""
    model = model_class.from_pretrained(str(base), local_files_only=True)
    return PeftModel.from_pretrained(model, str(lora)).merge_and_unload().eval()


def save_merged(base: Path, lora: Path, out: Path, model_class: Any = AutoModel) -> Path:
    """A copy of the model directory `base` (tokenizer and sentence-transformers files
    included) whose weights are the base's with the LoRA merged in."""
    shutil.copytree(base, out)
    merged_model(base, lora, model_class).save_pretrained(str(out))
    return out


def adapter_file_bytes(lora: Path) -> int:
    """The bytes of the tensors a saved LoRA holds."""
    tensors = load_file(str(lora / "adapter_model.safetensors"))
    return sum(t.numel() * t.element_size() for t in tensors.values())
