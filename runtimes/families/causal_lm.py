"""Text generation with a causal LM, whatever computes it: completions and chat, many
prompts in one decode loop.

Catalog `adapter: causal-lm`. Every prompt of every request of a batch runs in one
decode loop: an engine's `Decoding` runs the prefill and then one token per step with its
KV cache, and rows leave the batch as they finish. Greedy output matches
`model.generate(do_sample=False)` on the prompt alone; each row samples with its own
temperature, top_p and random generator, so a seeded request gives the same text
whatever else shares its batch (the engine's part: `runtimes.pytorch.causal_lm`).

Prompt tokens (`runtimes.families.prompts`, shared with the SGLang runtime): a text prompt
gets the tokenizer's BOS token when the tokenizer itself adds one (Llama, Mistral,
Gemma) and nothing otherwise (GPT-2, Qwen); end tokens a tokenizer appends (BERT's
[SEP]) are never added, as they would tell the model the text is over. Chat messages
are rendered by the tokenizer's chat template, which writes its own special tokens.

Only the request options steer decoding: the model's generation_config
(sampling defaults, repetition penalty, ...) is not applied; its EOS ids are.

Streaming: after every decode step the rows of streamed requests send the text
they gained (`Stream`); text that may still change is held back (an incomplete
UTF-8 character, the start of a stop string), so the deltas always add up to
the final text. The same call says which requests their callers abandoned:
those rows leave the batch at once (finish_reason "cancelled"). A result's
`latency` holds, per choice, its time to first token (from the batch's start)
and its mean time between tokens (`{"ttft_ms", "itl_ms"}`).

The family's logic is here, once: prompts and their checks, the passes' sizes, when a
row ends (EOS, stop strings, max_tokens), streaming, and the results. An engine's
subclass supplies the primitive: the model (`load`) and a generation step
(`decoding`'s `Decoding`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtimes.base import CANCELLED
from runtimes.child_side.adapter import Adapter, RowDelta, Stream
from runtimes.families.deltas import sendable
from runtimes.families.prompts import bos_id, check_prompt, prompt_ids
from runtimes.families.text import length_chunks, max_length
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


class Decoding(Protocol):
    """An engine's decode loop over some rows: the prefill and then one token per step,
    over the rows still in the batch (its slots, in the rows' order)."""

    def step(self) -> list[int]:
        """The next token of each slot (the first call runs the prefill)."""
        ...

    def advance(self, tokens: list[int], keep: list[int]) -> None:
        """Feed `tokens` (one per slot, `step`'s) back in; only the slots `keep` stay in
        the batch (those that left, their cache too, are dropped)."""
        ...


def eos_ids(*sources: Any) -> frozenset[int]:
    """The end ids of a generation config's and a tokenizer's `eos_token_id`s."""
    ids: set[int] = set()
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


class CausalLMAdapter(Adapter):
    """Catalog `adapter: causal-lm`: the generate operation."""

    streams = True
    tokenizer: Any  # set by `load`, called as transformers' tokenizers are

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        config, generation_eos = self.load(ref)
        self.context = max_length(self.tokenizer, config, entry.max_seq_length)
        self.eos_ids = eos_ids(generation_eos, self.tokenizer.eos_token_id)
        self.bos_id = bos_id(self.tokenizer)

    @abstractmethod
    def load(self, ref: str) -> tuple[Any, Any]:
        """Set `tokenizer` and load the model in `ref`: its config (max_position_embeddings)
        and its generation config's `eos_token_id`."""

    @abstractmethod
    def decoding(self, rows: list[Row]) -> Decoding:
        """A decode loop over `rows` (each row through its options.lora, where the engine
        serves them)."""

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

    def _decode(self, rows: list[Row], stream: Stream | None = None) -> list[Generated]:
        states = [Generated() for _ in rows]
        decoding = self.decoding(rows)
        active = list(range(len(rows)))  # row of each batch slot
        while True:
            tokens = decoding.step()
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
            decoding.advance(tokens, keep)
            if len(keep) < len(active):
                active = [active[slot] for slot in keep]

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
