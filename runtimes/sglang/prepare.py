"""What SGLang is sent for a request: the request checked against its model and tokenized
here, by the very rules of the PyTorch causal-lm adapter (`runtimes.families.prompts`), and each
generate item's body for SGLang's native `/generate` API (prompt token ids and sampling
parameters from the request's options)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, NamedTuple

from runtimes.base import Request
from runtimes.families.prompts import check_prompt, prompt_ids
from runtimes.families.token_ids import has_tokens
from runtimes.sglang.model import ServedModel
from tasks.errors import ErrorCode, ShoalError

# Requests with at most this many characters of text are tokenized on the runtime's loop.
INLINE_PREPARE_CHARS = 4096


class Prepared(NamedTuple):
    """A request checked and tokenized: its parsed kwargs and one list of token ids per item."""

    parsed: Any
    tokens: list[list[int]]


def text_chars(kwargs: Any) -> int:
    items = kwargs.get("items") if isinstance(kwargs, dict) else None
    total = 0
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("text"), str):
            total += len(item["text"])
        for message in item.get("messages") or () if isinstance(item.get("messages"), list) \
                else ():
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                total += len(message["content"])
    return total


async def prepare_soon(model: ServedModel, request: Request) -> Prepared:
    """Tokenize on this loop when the request is short (~40 us; the executor's hand-off
    cost 2.4 ms of a lone stream's time to first token, bench.sglang), else on a thread
    so that a long prompt does not stall the other streams."""
    if text_chars(request.kwargs) <= INLINE_PREPARE_CHARS:
        return prepare(model, request)
    return await asyncio.get_running_loop().run_in_executor(None, prepare, model, request)


def prepare(model: ServedModel, request: Request) -> Prepared:
    """The request checked and tokenized (ShoalError if it cannot be served)."""
    entry = model.entry
    if request.op != entry.operation:
        raise ShoalError(ErrorCode.UNSUPPORTED_OPERATION,
                         f"{entry.id} serves '{entry.operation}', not '{request.op}'")
    parsed = entry.parse(request.kwargs)
    if getattr(parsed.options, "lora", None) is not None:
        raise ShoalError(ErrorCode.MODEL_UNAVAILABLE,
                         f"{entry.id} runs on SGLang, and shoal's SGLang runtime "
                         "serves no LoRA adapters; leave options.lora unset")
    with model.tokenizer_lock:
        if model.generate:
            return Prepared(parsed, _prompts(model, parsed))
        return Prepared(parsed, _texts(model, parsed))


def _prompts(model: ServedModel, parsed: Any) -> list[list[int]]:
    """Each generate item's prompt ids, checked to leave room for max_tokens in the
    context (INPUT_TOO_LONG otherwise, without reaching SGLang)."""
    prompts = []
    for i, item in enumerate(parsed.items):
        ids = prompt_ids(model.tokenizer, model.bos, item, i, model.entry.id)
        check_prompt(ids, i, parsed.options.max_tokens, model.context)
        prompts.append(ids)
    return prompts


def _texts(model: ServedModel, parsed: Any) -> list[list[int]]:
    """Each encode text's ids behind the entry's query or document prompt, a tokens item's
    own ids (no prompt; `runtimes.families.token_ids`): one over the context is INPUT_TOO_LONG
    unless options.truncate cuts it."""
    from tasks.schema import check_encode_output

    entry = model.entry
    check_encode_output(parsed.options, entry.id, "dense", entry.dims or 0)
    prompt = entry.prompts.query if parsed.options.is_query else entry.prompts.document
    texts = [prompt + t for t in parsed.texts]
    tokens = has_tokens(parsed.items)
    if tokens:
        model.vocabulary().check(parsed.items, entry.id)
    full = model.tokenizer(texts, truncation=False, padding=False)["input_ids"]
    if tokens:
        full = [ids if item.tokens is None else list(item.tokens)
                for ids, item in zip(full, parsed.items, strict=True)]
    if not parsed.options.truncate:
        for i, ids in enumerate(full):
            if len(ids) > model.context:
                raise ShoalError(
                    ErrorCode.INPUT_TOO_LONG,
                    f"items[{i}] has {len(ids)} tokens, over the model's "
                    f"{model.context}; shorten it or set options.truncate to true")
    cut = model.tokenizer(texts, truncation=True, max_length=model.context,
                          padding=False)["input_ids"]
    if not tokens:
        return cut
    vocab = model.vocabulary()
    return [ids if item.tokens is None else vocab.fit(item.tokens, model.context)
            for ids, item in zip(cut, parsed.items, strict=True)]


def sampling_seed(seed: int, index: int) -> int:
    """One seed per item, from the request's seed and the item's index (items of a seeded
    request differ from each other, not from one run to the next)."""
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def sampling_params(options: Any, index: int) -> dict[str, Any]:
    """SGLang's sampling parameters for item `index` of a request with these options."""
    params: dict[str, Any] = {"max_new_tokens": options.max_tokens,
                              "temperature": options.temperature, "top_p": options.top_p,
                              "skip_special_tokens": True}
    if options.stop:
        params["stop"] = list(options.stop)
    if options.seed is not None:
        params["sampling_seed"] = sampling_seed(options.seed, index)
    return params


def generate_body(ids: list[int], options: Any, index: int, rid: str) -> dict[str, Any]:
    """The streamed `/generate` request of one item, under SGLang request id `rid`."""
    return {"input_ids": ids, "sampling_params": sampling_params(options, index),
            "stream": True, "rid": rid}
