"""Text generation with a causal LM: completions and chat, many prompts in one decode loop.

Catalog `adapter: causal-lm`. Every prompt of every request of a batch is
left-padded into one batch, run through one prefill forward and then decoded
one token per step with the KV cache; rows leave the batch as they finish.
Position ids come from the attention mask, so padding does not change a
row's result: greedy output matches `model.generate(do_sample=False)` on the
prompt alone. Each row samples with its own temperature, top_p and random
generator, so a seeded request gives the same text whatever else shares its
batch.

Prompt tokens: a text prompt gets the tokenizer's BOS token when the
tokenizer itself adds one (Llama, Mistral, Gemma) and nothing otherwise
(GPT-2, Qwen); end tokens a tokenizer appends (BERT's [SEP]) are never added,
as they would tell the model the text is over. Chat messages are rendered by
the tokenizer's chat template, which writes its own special tokens.

Only the request options steer decoding: the model's generation_config
(sampling defaults, repetition penalty, ...) is not applied; its EOS ids are.

LoRA adapters: each row runs through its request's options.lora (or the base
model) in every forward of the loop, prefill and decode steps alike, so rows
of different LoRAs share the batch (`runtimes.pytorch.lora`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jinja2 import TemplateError
from transformers import AutoModelForCausalLM

from app.catalog import ModelEntry
from runtimes.pytorch.adapter import Adapter
from runtimes.pytorch.loading import load_model, pad_id
from runtimes.pytorch.lora import LoraSet
from runtimes.pytorch.text import length_chunks, max_length, pad
from tasks.errors import ErrorCode, ShoalError
from tasks.schema import GenerateOptions, Item, ParsedRequest, invalid

STOP = "stop"
LENGTH = "length"


@dataclass(frozen=True, slots=True)
class Prepared:
    """One checked request: the token ids of each item's prompt."""

    prompts: list[list[int]]
    options: GenerateOptions


@dataclass(frozen=True, slots=True)
class Row:
    """One prompt to complete; `index` is its item's place in its request."""

    prompt: list[int]
    options: GenerateOptions
    index: int = 0


@dataclass(slots=True)
class Generated:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def too_long(index: int, prompt: int, max_tokens: int, context: int) -> ShoalError:
    return ShoalError(
        ErrorCode.INPUT_TOO_LONG,
        f"items[{index}] has {prompt} prompt tokens and options.max_tokens is {max_tokens}: "
        f"{prompt + max_tokens} tokens, over the model's context of {context}; shorten the "
        "prompt or lower options.max_tokens",
    )


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


def _eos_ids(*sources: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


class CausalLMAdapter(Adapter):
    """Catalog `adapter: causal-lm`: the generate operation."""

    supports_lora = True

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.tokenizer, self.model, _ = load_model(AutoModelForCausalLM, ref, self.device)
        self.loras = LoraSet(self.model, entry.id)
        self.context = max_length(self.tokenizer, self.model.config, entry.max_seq_length)
        self.eos_ids = _eos_ids(self.model.generation_config.eos_token_id,
                                self.tokenizer.eos_token_id)
        # Without a pad token an end token pads: the mask hides it either way.
        self.pad_id = pad_id(self.tokenizer, *sorted(self.eos_ids))
        self.bos_id = self._bos_id()
        # Transformers 5 renamed `past_key_values` to `cache` (argument and output).
        params = inspect.signature(self.model.forward).parameters
        self._cache_name = "cache" if "cache" in params else "past_key_values"
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def _bos_id(self) -> int | None:
        """The BOS id when the tokenizer puts one before a text by itself, else None."""
        bos = self.tokenizer.bos_token_id
        if bos is None:
            return None
        with_special = self.tokenizer("a")["input_ids"]
        plain = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        return bos if with_special[:1] == [bos] and plain[:1] != [bos] else None

    def prompt_ids(self, item: Item, index: int) -> list[int]:
        if item.messages is None:
            ids = self.tokenizer(item.text or "", add_special_tokens=False)["input_ids"]
            return ids if self.bos_id is None else [self.bos_id, *ids]
        if not self.tokenizer.chat_template:
            raise invalid(f"{self.entry.id} has no chat template; send a plain prompt to "
                          "/v1/completions instead")
        messages = [{"role": role, "content": content} for role, content in item.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        except TemplateError as exc:
            raise invalid(f"items[{index}].messages: {self.entry.id}'s chat template refused "
                          f"them: {exc}") from None
        # The template wrote the special tokens it wants; adding them again doubles BOS.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check(self, parsed: ParsedRequest) -> Prepared:
        options: GenerateOptions = parsed.options
        prompts = []
        for i, item in enumerate(parsed.items):
            ids = self.prompt_ids(item, i)
            if not ids:
                raise invalid(f"items[{i}] is empty; send a prompt of at least one token")
            if len(ids) + options.max_tokens > self.context:
                raise too_long(i, len(ids), options.max_tokens, self.context)
            prompts.append(ids)
        return Prepared(prompts, options)

    def run(self, prepared: list[Prepared]) -> list[dict[str, Any]]:
        rows = [Row(ids, p.options, i) for p in prepared for i, ids in enumerate(p.prompts)]
        generated = self.generate(rows)
        results, offset = [], 0
        for p in prepared:
            choices = []
            for i, ids in enumerate(p.prompts):
                out = generated[offset + i]
                choices.append({"index": i, "text": out.text, "finish_reason": out.finish_reason,
                                "prompt_tokens": len(ids),
                                "completion_tokens": len(out.token_ids)})
            offset += len(p.prompts)
            prompt = sum(c["prompt_tokens"] for c in choices)
            completion = sum(c["completion_tokens"] for c in choices)
            results.append({"choices": choices, "usage": {
                "tokens": prompt + completion, "prompt_tokens": prompt,
                "completion_tokens": completion,
            }})
        return results

    def generate(self, rows: list[Row]) -> list[Generated]:
        """The completion of each row, in order. Rows run together unless their padded
        prompt + completion tokens exceed `chunk_tokens`, which bounds the KV cache."""
        out: list[Generated] = [Generated() for _ in rows]
        lengths = [len(r.prompt) + r.options.max_tokens for r in rows]
        for chunk in length_chunks(lengths, self.chunk_tokens):
            for i, generated in zip(chunk, self._decode([rows[i] for i in chunk]), strict=True):
                out[i] = generated
        return out

    @torch.inference_mode()
    def _decode(self, rows: list[Row]) -> list[Generated]:
        device = self.device
        states = [Generated() for _ in rows]
        generators = [row_generator(r.options.seed, r.index) if r.options.temperature > 0
                      else None for r in rows]
        input_ids = pad([r.prompt for r in rows], self.pad_id, left=True).to(device)
        mask = pad([[1] * len(r.prompt) for r in rows], 0, left=True).to(device)
        # Count positions from each row's first real token, as if it had no padding.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        active = list(range(len(rows)))  # row of each batch slot
        loras = [r.options.lora for r in rows]
        cache = None
        while True:
            output = self.loras.forward(
                [loras[i] for i in active] if any(loras) else None, input_ids=input_ids,
                attention_mask=mask, position_ids=positions, use_cache=True,
                **{self._cache_name: cache}, **self._last_logits)
            cache = getattr(output, self._cache_name)
            tokens = self._pick(output.logits[:, -1, :].float(),
                                [rows[i].options for i in active], [generators[i] for i in active])
            keep = [slot for slot, (i, token) in enumerate(zip(active, tokens, strict=True))
                    if not self._step(states[i], token, rows[i].options)]
            if not keep:
                return states
            next_ids = torch.tensor(tokens, dtype=torch.long, device=device)
            last = positions[:, -1]
            if len(keep) < len(active):
                # Finished rows leave the batch, cache included.
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.reorder_cache(index)
                mask, next_ids, last = mask[index], next_ids[index], last[index]
                active = [active[slot] for slot in keep]
            input_ids = next_ids[:, None]
            positions = (last + 1)[:, None]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)

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

    def _step(self, state: Generated, token: int, options: GenerateOptions) -> bool:
        """Add `token` to a row; whether the row is now finished."""
        state.token_ids.append(token)
        if token in self.eos_ids:
            state.text = self._decode_text(state.token_ids[:-1])
            state.finish_reason = STOP
            return True
        if options.stop:
            text = self._decode_text(state.token_ids)
            cut = min((i for i in (text.find(s) for s in options.stop) if i >= 0), default=-1)
            if cut >= 0:
                state.text, state.finish_reason = text[:cut], STOP
                return True
        if len(state.token_ids) >= options.max_tokens:
            state.text = self._decode_text(state.token_ids)
            state.finish_reason = LENGTH
            return True
        return False

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
