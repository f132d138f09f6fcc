"""Text generation with a causal LM: completions and chat, many prompts in one decode loop.

Catalog `adapter: causal-lm`. Every prompt of every request of a batch is
left-padded into one batch, run through one prefill forward and then decoded
one token per step with the KV cache; rows leave the batch as they finish.
Position ids come from the attention mask, so padding does not change a
row's result: greedy output matches `model.generate(do_sample=False)` on the
prompt alone. Each row samples with its own temperature, top_p and random
generator, so a seeded request gives the same text whatever else shares its
batch.

Prompt tokens (`runtimes.families.prompts`, shared with the SGLang runtime): a text prompt
gets the tokenizer's BOS token when the tokenizer itself adds one (Llama, Mistral,
Gemma) and nothing otherwise (GPT-2, Qwen); end tokens a tokenizer appends (BERT's
[SEP]) are never added, as they would tell the model the text is over. Chat messages
are rendered by the tokenizer's chat template, which writes its own special tokens.

Only the request options steer decoding: the model's generation_config
(sampling defaults, repetition penalty, ...) is not applied; its EOS ids are.

LoRA adapters: each row runs through its request's options.lora (or the base
model) in every forward of the loop, prefill and decode steps alike, so rows
of different LoRAs share the batch (`runtimes.pytorch.lora`).

Streaming: after every decode step the rows of streamed requests send the text
they gained (`Stream`); text that may still change is held back (an incomplete
UTF-8 character, the start of a stop string), so the deltas always add up to
the final text. The same call says which requests their callers abandoned:
those rows leave the batch at once (finish_reason "cancelled"). A result's
`latency` holds, per choice, its time to first token (from the batch's start)
and its mean time between tokens (`{"ttft_ms", "itl_ms"}`).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from runtimes.base import CANCELLED
from runtimes.child_side.adapter import RowDelta, Stream
from runtimes.families.deltas import sendable
from runtimes.families.prompts import bos_id, check_prompt, prompt_ids
from runtimes.pytorch.adapter import Adapter
from runtimes.pytorch.loading import load_model, pad_id
from runtimes.pytorch.lora import LoraSet
from runtimes.pytorch.text import length_chunks, max_length, pad
from tasks.catalog import ModelEntry
from tasks.options import GenerateOptions
from tasks.schema import Item, ParsedRequest

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
    request: int = 0  # its request's place in the batch


@dataclass(slots=True)
class Generated:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    sent: str = ""  # the text streamed so far
    first_at: float | None = None  # perf_counter of its first token
    last_at: float | None = None


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
        self.tokenizer, self.model, _ = load_model(AutoModelForCausalLM, ref, self.device,
                                              self.dtype)
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
        return bos_id(self.tokenizer)

    def prompt_ids(self, item: Item, index: int) -> list[int]:
        """Built by `runtimes.families.prompts`, as the SGLang runtime builds them."""
        return prompt_ids(self.tokenizer, self.bos_id, item, index, self.entry.id)

    def check(self, parsed: ParsedRequest) -> Prepared:
        options: GenerateOptions = parsed.options
        prompts = []
        for i, item in enumerate(parsed.items):
            ids = self.prompt_ids(item, i)
            check_prompt(ids, i, options.max_tokens, self.context)
            prompts.append(ids)
        return Prepared(prompts, options)

    streams = True

    def run(self, prepared: list[Prepared], stream: Stream | None = None
            ) -> list[dict[str, Any]]:
        rows = [Row(ids, p.options, i, n) for n, p in enumerate(prepared)
                for i, ids in enumerate(p.prompts)]
        started = time.perf_counter()
        generated = self.generate(rows, stream)
        results, offset = [], 0
        for p in prepared:
            choices, latency = [], []
            for i, ids in enumerate(p.prompts):
                out = generated[offset + i]
                choices.append({"index": i, "text": out.text, "finish_reason": out.finish_reason,
                                "prompt_tokens": len(ids),
                                "completion_tokens": len(out.token_ids)})
                latency.append(_latencies(out, started))
            offset += len(p.prompts)
            prompt = sum(c["prompt_tokens"] for c in choices)
            completion = sum(c["completion_tokens"] for c in choices)
            results.append({"choices": choices, "latency": latency, "usage": {
                "tokens": prompt + completion, "prompt_tokens": prompt,
                "completion_tokens": completion,
            }})
        return results

    def generate(self, rows: list[Row], stream: Stream | None = None) -> list[Generated]:
        """The completion of each row, in order. Rows run together unless their padded
        prompt + completion tokens exceed `chunk_tokens`, which bounds the KV cache."""
        out: list[Generated] = [Generated() for _ in rows]
        lengths = [len(r.prompt) + r.options.max_tokens for r in rows]
        for chunk in length_chunks(lengths, self.chunk_tokens):
            decoded = self._decode([rows[i] for i in chunk], stream)
            for i, generated in zip(chunk, decoded, strict=True):
                out[i] = generated
        return out

    @torch.inference_mode()
    def _decode(self, rows: list[Row], stream: Stream | None = None) -> list[Generated]:
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
            now = time.perf_counter()
            for i in active:
                states[i].first_at = states[i].first_at or now
                states[i].last_at = now
            if stream is not None:
                left = self._send(stream, rows, states, active)
                keep = [slot for slot in keep if rows[active[slot]].request not in left]
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

    def _send(self, stream: Stream, rows: list[Row], states: list[Generated],
              active: list[int]) -> set[int]:
        """Send this step's deltas; the requests whose callers left, their unfinished rows
        ended as cancelled."""
        deltas: list[RowDelta] = []
        for i in active:
            row, state = rows[i], states[i]
            if row.request in stream.requests:
                text = self._streamable(state, row.options)
                if text:
                    deltas.append((row.request, row.index, text, len(state.token_ids)))
        left = stream.send(deltas)
        for i in active:
            state = states[i]
            if rows[i].request in left and state.finish_reason is None:
                state.text = self._decode_text(state.token_ids)
                state.finish_reason = CANCELLED
        return left

    def _streamable(self, state: Generated, options: GenerateOptions) -> str:
        """The text a row gained since its last delta (all of the rest once it finished)."""
        final = state.finish_reason is not None
        text = state.text if final else self._decode_text(state.token_ids)
        sent = sendable(text, state.sent, options.stop, final)
        delta, state.sent = sent[len(state.sent):], sent
        return delta

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


def _latencies(out: Generated, started: float) -> dict[str, float]:
    """Time to first token (from the batch's start) and mean time between tokens, in ms."""
    if out.first_at is None or out.last_at is None:
        return {}
    between = (out.last_at - out.first_at) / max(1, len(out.token_ids) - 1)
    return {"ttft_ms": round((out.first_at - started) * 1000, 3),
            "itl_ms": round(between * 1000, 3)}
