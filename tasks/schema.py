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
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tasks.adapters import CLASSIFY, ENCODE, EXTRACT, GENERATE, IMAGE, SCORE, TEXT
from tasks.errors import ErrorCode, ShoalError, invalid
from tasks.render import names, shown

DTYPES = ("float32", "float16", "int8", "binary")
AGGREGATIONS = ("simple", "first", "average", "max", "none")
ACTIVATIONS = ("sigmoid", "softmax", "none")
ROLES = ("system", "user", "assistant")
MAX_STOP_SEQUENCES = 4
MAX_LABELS = 64
MAX_NEW_TOKENS = 4096
# The largest token id a tokens item may carry: no vocabulary comes near it, and every id
# below it fits the int64 (and int32) arrays runtimes pad ids into. Which ids a model
# knows is its runtime's to say (`runtimes.families.token_ids`): the contract has no tokenizer.
MAX_TOKEN_ID = 2**31 - 1
TOKENS_FOR = "token-id input is for dense embeddings and completions"
# Zero-shot's hypothesis when the caller and the catalog give none (as transformers' pipeline).
DEFAULT_HYPOTHESIS = "This example is {}."


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
class EncodeOptions:
    normalize: bool | None = None  # None: the model's own default
    dimensions: int | None = None  # Matryoshka: keep the first N dimensions
    truncate: bool = True
    dtype: str = "float32"
    output: str | None = None  # None: the adapter's first output kind
    is_query: bool = False  # use the entry's query prompt instead of its document prompt
    lora: str | None = None  # a LoRA adapter of the model's catalog entry (`ModelEntry.loras`)


@dataclass(frozen=True, slots=True)
class ScoreOptions:
    truncate: bool = True
    top_n: int | None = None
    activation: str | None = None  # None: sigmoid for one logit, else softmax's last class


@dataclass(frozen=True, slots=True)
class ExtractOptions:
    truncate: bool = True
    aggregation: str = "simple"
    threshold: float = 0.0


@dataclass(frozen=True, slots=True)
class ClassifyOptions:
    truncate: bool = True
    labels: tuple[str, ...] | None = None  # zero-shot: the candidate labels
    multi_label: bool = False
    hypothesis_template: str | None = None  # zero-shot: "This example is {}."
    top_k: int | None = None


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    lora: str | None = None  # a LoRA adapter of the model's catalog entry (`ModelEntry.loras`)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    op: str
    items: list[Item]
    options: Any  # the op's *Options dataclass
    query: str | None = None

    @property
    def texts(self) -> list[str]:
        return [i.text or "" for i in self.items]


# --- option checkers -----------------------------------------------------------------------


def _bool(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise invalid(f"options.{name} must be true or false")
        return value
    return check


def _choice(name: str, allowed: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in allowed:
            raise invalid(f"options.{name} must be one of {list(allowed)}, got {shown(value)}")
        return value
    return check


def _int(name: str, low: int, high: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high
        ):
            upper = f" to {high}" if high is not None else " or more"
            raise invalid(f"options.{name} must be an integer from {low}{upper}")
        return value
    return check


def _float(name: str, low: float, high: float, low_open: bool = False) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        ok = not isinstance(value, bool) and isinstance(value, int | float)
        if ok:
            value = float(value)
            ok = (value > low if low_open else value >= low) and value <= high
        if not ok:
            bound = "over" if low_open else "from"
            raise invalid(f"options.{name} must be a number {bound} {low} to {high}")
        return value
    return check


def _nullable(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _labels(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, str) and v.strip() for v in value)):
        raise invalid("options.labels must be a non-empty list of non-empty strings")
    if len(value) > MAX_LABELS:
        raise invalid(f"options.labels has {len(value)} labels, over the limit of {MAX_LABELS}")
    if len(set(value)) != len(value):
        raise invalid("options.labels has duplicates")
    return tuple(value)


def _template(value: Any) -> str:
    if not isinstance(value, str) or value.count("{}") != 1:
        raise invalid("options.hypothesis_template must be a string with one '{}' where the "
                      "label goes, e.g. 'This example is {}.'")
    return value


def _lora(value: Any) -> str:
    # Which names exist is the catalog entry's to say (`ModelEntry.parse`: LORA_NOT_FOUND).
    if not isinstance(value, str) or not value:
        raise invalid("options.lora must be the name of one of the model's LoRA adapters")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise invalid("options.stop must be a non-empty string or a list of them")
    if len(value) > MAX_STOP_SEQUENCES:
        raise invalid(f"options.stop takes at most {MAX_STOP_SEQUENCES} sequences")
    return tuple(value)


_OPTIONS: dict[str, tuple[type, dict[str, Callable[[Any], Any]]]] = {
    ENCODE: (EncodeOptions, {
        "normalize": _nullable(_bool("normalize")),
        "dimensions": _nullable(_int("dimensions", 1)),
        "truncate": _bool("truncate"),
        "dtype": _choice("dtype", DTYPES),
        "output": _nullable(_choice("output", ("dense", "sparse", "multivector"))),
        "is_query": _bool("is_query"),
        "lora": _nullable(_lora),
    }),
    SCORE: (ScoreOptions, {
        "truncate": _bool("truncate"),
        "top_n": _nullable(_int("top_n", 1)),
        "activation": _nullable(_choice("activation", ACTIVATIONS)),
    }),
    EXTRACT: (ExtractOptions, {
        "truncate": _bool("truncate"),
        "aggregation": _choice("aggregation", AGGREGATIONS),
        "threshold": _float("threshold", 0.0, 1.0),
    }),
    CLASSIFY: (ClassifyOptions, {
        "truncate": _bool("truncate"),
        "labels": _nullable(_labels),
        "multi_label": _bool("multi_label"),
        "hypothesis_template": _nullable(_template),
        "top_k": _nullable(_int("top_k", 1)),
    }),
    GENERATE: (GenerateOptions, {
        "max_tokens": _int("max_tokens", 1, MAX_NEW_TOKENS),
        "temperature": _float("temperature", 0.0, 2.0),
        "top_p": _float("top_p", 0.0, 1.0, low_open=True),
        "stop": _stop,
        "seed": _nullable(_int("seed", 0, 2**63 - 1)),
        "lora": _nullable(_lora),
    }),
}


def option_names(op: str) -> list[str]:
    return sorted(_OPTIONS[op][1])


def parse_options(op: str, options: Any, defaults: Mapping[str, Any] | None = None) -> Any:
    """The op's options dataclass from the caller's options over the entry's defaults."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise invalid("'options' must be an object")
    cls, checks = _OPTIONS[op]
    merged = {**(defaults or {}), **options}
    unknown = set(merged) - set(checks)
    if unknown:
        raise invalid(f"unknown options {names(unknown)} for {op}; allowed: {sorted(checks)}")
    return cls(**{name: checks[name](value) for name, value in merged.items()})


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
    if op not in _OPTIONS:
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
