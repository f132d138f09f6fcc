"""Text generation on PyTorch: the causal-LM family's primitive (`runtimes.families.causal_lm`),
a decode loop with the KV cache, each row sampled on its own.

Every prompt of a decode loop is left-padded into one batch, run through one prefill
forward and then decoded one token per step; rows leave the batch (their cache too) as
the family ends them. Position ids come from the attention mask, so padding does not
change a row's result: greedy output matches `model.generate(do_sample=False)` on the
prompt alone. Each row samples with its own temperature, top_p and random generator.

LoRA adapters: each row runs through its request's options.lora (or the base
model) in every forward of the loop, prefill and decode steps alike, so rows
of different LoRAs share the batch (`runtimes.pytorch.lora`).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from runtimes.families import causal_lm
from runtimes.families.causal_lm import Generated, Row
from runtimes.model_files.precision import torch_dtype
from runtimes.pytorch.loading import load_model, pad_id
from runtimes.pytorch.lora import LoraSet
from runtimes.pytorch.text import pad
from tasks.catalog import ModelEntry
from tasks.options import GenerateOptions

__all__ = ["CausalLMAdapter", "Generated", "Row", "row_generator"]


def row_generator(seed: int | None, index: int) -> torch.Generator:
    """The random stream of one row: from the request's seed and the item's index, so the
    items of a seeded request differ from each other but not from one run to the next."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        state = np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0]
        generator.manual_seed(int(state))
    return generator


class TorchDecoding:
    """One decode loop's tensors: the padded batch, its positions and its KV cache."""

    def __init__(self, adapter: CausalLMAdapter, rows: list[Row]) -> None:
        self.adapter = adapter
        device = adapter.device
        self.device = device
        self.options = [r.options for r in rows]
        self.generators = [row_generator(r.options.seed, r.index) if r.options.temperature > 0
                           else None for r in rows]
        with torch.inference_mode():
            self.input_ids = pad([r.prompt for r in rows], adapter.pad_id, left=True).to(device)
            self.mask = pad([[1] * len(r.prompt) for r in rows], 0, left=True).to(device)
            # Count positions from each row's first real token, as if it had no padding.
            self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.active = list(range(len(rows)))  # row of each batch slot
        self.loras = [r.options.lora for r in rows]
        self.cache: Any = None

    @torch.inference_mode()
    def step(self) -> list[int]:
        adapter, active = self.adapter, self.active
        output = adapter.loras.forward(
            [self.loras[i] for i in active] if any(self.loras) else None,
            input_ids=self.input_ids, attention_mask=self.mask, position_ids=self.positions,
            use_cache=True, **{adapter.cache_name: self.cache}, **adapter.last_logits)
        self.cache = getattr(output, adapter.cache_name)
        return adapter._pick(output.logits[:, -1, :].float(), [self.options[i] for i in active],
                             [self.generators[i] for i in active])

    @torch.inference_mode()
    def advance(self, tokens: list[int], keep: list[int]) -> None:
        device = self.device
        next_ids = torch.tensor(tokens, dtype=torch.long, device=device)
        last = self.positions[:, -1]
        mask = self.mask
        if len(keep) < len(self.active):
            # Finished rows leave the batch, cache included.
            index = torch.tensor(keep, dtype=torch.long, device=device)
            self.cache.reorder_cache(index)
            mask, next_ids, last = mask[index], next_ids[index], last[index]
            self.active = [self.active[slot] for slot in keep]
        self.input_ids = next_ids[:, None]
        self.positions = (last + 1)[:, None]
        self.mask = torch.cat([mask, mask.new_ones((len(self.active), 1))], dim=1)


class CausalLMAdapter(causal_lm.CausalLMAdapter):
    """Catalog `adapter: causal-lm` on PyTorch, with LoRA adapters."""

    supports_lora = True

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        # Without a pad token an end token pads: the mask hides it either way.
        self.pad_id = pad_id(self.tokenizer, *sorted(self.eos_ids))

    def load(self, ref: str) -> tuple[Any, Any]:
        self.tokenizer, self.model, _ = load_model(AutoModelForCausalLM, ref, self.device,
                                                   torch_dtype(self.precision))
        self.loras = LoraSet(self.model, self.entry.id)
        # Transformers 5 renamed `past_key_values` to `cache` (argument and output).
        params = inspect.signature(self.model.forward).parameters
        self.cache_name = "cache" if "cache" in params else "past_key_values"
        self.last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        return self.model.config, self.model.generation_config.eos_token_id

    def decoding(self, rows: list[Row]) -> TorchDecoding:
        return TorchDecoding(self, rows)

    def _pick(self, logits: torch.Tensor, options: list[GenerateOptions],
              generators: list[torch.Generator | None]) -> list[int]:
        """The next token of each row: argmax at temperature 0, else a draw from the
        tempered distribution cut to its top_p nucleus."""
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [slot for slot, o in enumerate(options) if o.temperature > 0]
        if not sampled:
            return tokens
        device = logits.device
        index = torch.tensor(sampled, dtype=torch.long, device=device)
        temperature = torch.tensor([options[s].temperature for s in sampled], device=device)
        top_p = torch.tensor([options[s].top_p for s in sampled], device=device)
        probs = torch.softmax(logits[index] / temperature[:, None], dim=-1)
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        # Keep the most likely tokens until their mass reaches top_p (the first always).
        kept = (probs.cumsum(dim=-1) - probs) < top_p[:, None]
        cdf = (probs * kept).cumsum(dim=-1)
        # One uniform per row from the row's own generator, drawn on the CPU so the
        # stream does not depend on the device or on the other rows.
        uniform = torch.tensor([torch.rand((), generator=generators[s]).item() for s in sampled],
                               device=device)
        choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
        choice = torch.minimum(choice, kept.sum(dim=-1, keepdim=True) - 1)
        for slot, token in zip(sampled, order.gather(-1, choice)[:, 0].tolist(), strict=True):
            tokens[slot] = token
        return tokens
