"""The kwargs schema of each task, checked wherever a request enters.

The gateway checks a request before publishing it; Celery clients publish
straight to the queue, so the runtime checks again with the same function and
answers a bad request with a VALIDATION_ERROR instead of failing the batch.

Every task's kwargs are `{"model", "items": [...], "options": {...}}` (score
adds `"query"`). An item is `{"text": str}`, `{"image": bytes}` (base64 text is
accepted too; the gateway turns it into bytes), for generation
`{"messages": [{"role", "content"}]}`, or, for the models that take them (dense
embedders and causal LMs: `tasks.catalog.TOKEN_ADAPTERS`), `{"tokens": [int, ...]}`:
the model's input ids exactly as its own tokenizer gives them for a text, special
tokens included (`tokenizer(text)["input_ids"]`), which skip the tokenizer, the
entry's prompts and lowercasing. A catalog entry's `defaults` are merged under the
caller's options.

This module owns a request's shape and its items; each operation's options (their
dataclasses and checks) are `tasks.options`'.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.adapters import ENCODE, GENERATE, IMAGE, SCORE, TEXT
from tasks.errors import ErrorCode, ShoalError, invalid
from tasks.options import OPTIONS, EncodeOptions, parse_options
from tasks.render import shown

ROLES = ("system", "user", "assistant")
# The largest token id a tokens item may carry: no vocabulary comes near it, and every id
# below it fits the int64 (and int32) arrays runtimes pad ids into. Which ids a model
# knows is its runtime's to say (`runtimes.families.token_ids`): the contract has no tokenizer.
MAX_TOKEN_ID = 2**31 - 1
TOKENS_FOR = "token-id input is for dense embeddings and completions"


@dataclass(frozen=True, slots=True)
class Item:
    """One input: exactly one of text, image bytes, chat messages or token ids."""

    text: str | None = None
    image: bytes | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    tokens: tuple[int, ...] | None = None  # the model's own input ids, special tokens included

    @property
    def kind(self) -> str:
        return IMAGE if self.image is not None else TEXT


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    op: str
    items: list[Item]
    options: Any  # the op's *Options dataclass (`tasks.options`)
    query: str | None = None

    @property
    def texts(self) -> list[str]:
        return [i.text or "" for i in self.items]


# --- items ---------------------------------------------------------------------------------


def image_bytes(value: Any, where: str) -> bytes:
    """Raw image bytes from bytes, base64 text or a base64 data URL."""
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
    elif isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(f"{where}.image is not valid base64; send the image's bytes "
                          "base64-encoded in JSON or raw in msgpack") from None
    else:
        raise invalid(f"{where}.image must be bytes (msgpack) or a base64 string (JSON)")
    if not data:
        raise invalid(f"{where}.image is empty")
    return data


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise invalid(f"{where}.messages must be a non-empty list of {{'role', 'content'}}")
    out = []
    for j, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise invalid(f"{where}.messages[{j}] must have a role in {list(ROLES)} and a "
                          "string content")
        out.append((role, content))
    return tuple(out)


def check_token_ids(value: Any, where: str) -> None:
    """VALIDATION_ERROR naming `where` (e.g. "items[3].tokens") unless `value` is a
    non-empty list of plain integers from 0 to MAX_TOKEN_ID: token ids."""
    if type(value) is not list or not value:
        raise invalid(f"{where} must be a non-empty list of token ids (integers from 0)")
    # One pass in C for the common case; the slow loop only finds what to name.
    if all(type(t) is int for t in value) and min(value) >= 0 and max(value) <= MAX_TOKEN_ID:
        return
    for j, t in enumerate(value):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise invalid(f"{where}[{j}] is {shown(t)}; a token id is an integer from 0 to "
                          f"{MAX_TOKEN_ID}")


def parse_items(items: Any, inputs: frozenset[str], model: str = "this model",
                messages: bool = False, tokens: bool = False) -> list[Item]:
    """Items checked against what the model takes (`inputs`: 'text', 'image'; `tokens`:
    whether it takes token ids)."""
    if not isinstance(items, list) or not items:
        raise invalid("'items' must be a non-empty list of {'text': str}"
                      + (" or {'image': bytes}" if IMAGE in inputs else ""))
    parsed: list[Item] = []
    for i, item in enumerate(items):
        # The common case first, with nothing built that only an error message needs.
        if type(item) is dict and len(item) == 1 and type(text := item.get("text")) is str:
            parsed.append(Item(text=text))
            continue
        where = f"items[{i}]"
        if not isinstance(item, dict) or len(item) != 1:
            raise invalid(f"{where} must be an object with exactly one of 'text'"
                          + (", 'image'" if IMAGE in inputs else "")
                          + (", 'messages'" if messages else "")
                          + (", 'tokens'" if tokens else ""))
        ((key, value),) = item.items()
        if key == "text":
            if not isinstance(value, str):
                raise invalid(f"{where}.text must be a string")
            parsed.append(Item(text=value))
        elif key == "image":
            if IMAGE not in inputs:
                raise invalid(f"{where} is an image, but {model} takes text only")
            parsed.append(Item(image=image_bytes(value, where)))
        elif key == "messages" and messages:
            parsed.append(Item(messages=_messages(value, where)))
        elif key == "tokens":
            if not tokens or TEXT not in inputs:
                raise invalid(f"{where} is token ids, but {model} does not take them: "
                              f"{TOKENS_FOR}; send {{'text': ...}} instead")
            check_token_ids(value, f"{where}.tokens")
            parsed.append(Item(tokens=tuple(value)))
        else:
            raise invalid(f"{where} has an unknown field {shown(key)}")
    return parsed


def parse_request(op: str, kwargs: Any, inputs: frozenset[str] = frozenset({TEXT}),
                  defaults: Mapping[str, Any] | None = None,
                  model: str = "this model", tokens: bool = False) -> ParsedRequest:
    """Check a task's kwargs for `op`; raises ShoalError(VALIDATION_ERROR). `tokens`:
    whether the model takes token-id items."""
    if not isinstance(kwargs, dict):
        raise invalid("task kwargs must be an object")
    if op not in OPTIONS:
        raise ShoalError(ErrorCode.UNSUPPORTED_OPERATION, f"unknown operation {shown(op)}")
    stream = kwargs.get("stream", False)
    if not isinstance(stream, bool) or (stream and op != GENERATE):
        raise invalid(f"'stream' must be true or false, and true only for generate, not {op}")
    items = parse_items(kwargs.get("items"), inputs, model, messages=op == GENERATE,
                        tokens=tokens)
    options = parse_options(op, kwargs.get("options"), defaults)
    query = kwargs.get("query")
    if op == SCORE:
        if not isinstance(query, str) or not query:
            raise invalid("'query' is missing: score needs a non-empty string 'query' to "
                          "score the items against")
    elif query is not None:
        raise invalid(f"'query' is only for score, not {op}")
    return ParsedRequest(op, items, options, query)


def parse_encode(kwargs: dict[str, Any], dims: int | None,
                 inputs: frozenset[str] = frozenset({TEXT}),
                 defaults: Mapping[str, Any] | None = None,
                 model: str = "this model", kind: str = "dense",
                 tokens: bool = False) -> ParsedRequest:
    """An encode request, its options checked against the model's kind of embedding and
    width (`check_encode_output`)."""
    parsed = parse_request(ENCODE, kwargs, inputs, defaults, model, tokens)
    check_encode_output(parsed.options, model, kind, dims)
    return parsed


def check_encode_output(options: EncodeOptions, model: str, kind: str,
                        dims: int | None) -> None:
    """Options that make no sense for a model's kind of embedding (`kind`: dense, sparse or
    multivector). Needs no weights: the gateway, every runtime and the sim share it."""
    if options.output not in (None, kind):
        raise invalid(f"options.output: {model} gives {kind} embeddings, not "
                      f"{options.output}; leave output unset or '{kind}'")
    if kind == "dense":
        if options.dimensions is not None and dims is not None and options.dimensions > dims:
            raise invalid(f"options.dimensions must be an integer from 1 to {dims}")
        return
    if options.dtype != "float32":
        raise invalid(f"options.dtype: {model}'s {kind} embeddings are float32 only; leave "
                      "dtype unset or 'float32'")
    if options.dimensions is not None:
        what = "one weight per vocabulary term" if kind == "sparse" else \
            f"{dims}-dim token vectors"
        raise invalid(f"options.dimensions: {model} gives {what}, which cannot be shortened; "
                      "leave dimensions unset")
    if kind == "sparse" and options.normalize:
        raise invalid(f"options.normalize: {model}'s sparse weights are not normalised (their "
                      "scale is what dot-product scoring compares); leave normalize unset or "
                      "false")
    if kind == "multivector" and options.normalize is False:
        raise invalid(f"options.normalize: {model}'s token vectors are always unit length "
                      "(MaxSim scoring expects them); leave normalize unset or true")
