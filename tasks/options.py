"""The options each operation takes: one frozen dataclass per operation, a check per
option, and `parse_options`, which merges the caller's options over a catalog entry's
`defaults` and checks each.

Part of the request contract (`tasks.schema` checks the rest of a request and calls
this); a new option is a field of its operation's dataclass and a line in `OPTIONS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tasks.adapters import CLASSIFY, ENCODE, EXTRACT, GENERATE, SCORE
from tasks.errors import invalid
from tasks.render import names, shown

DTYPES = ("float32", "float16", "int8", "binary")
AGGREGATIONS = ("simple", "first", "average", "max", "none")
ACTIVATIONS = ("sigmoid", "softmax", "none")
MAX_STOP_SEQUENCES = 4
MAX_LABELS = 64
MAX_NEW_TOKENS = 4096
# Zero-shot's hypothesis when the caller and the catalog give none (as transformers' pipeline).
DEFAULT_HYPOTHESIS = "This example is {}."


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


# --- checks -----------------------------------------------------------------------


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


# Each operation's options dataclass and a check per option (its value as the dataclass
# takes it, or VALIDATION_ERROR).
OPTIONS: dict[str, tuple[type, dict[str, Callable[[Any], Any]]]] = {
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
    return sorted(OPTIONS[op][1])


def parse_options(op: str, options: Any, defaults: Mapping[str, Any] | None = None) -> Any:
    """The op's options dataclass from the caller's options over the entry's defaults."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise invalid("'options' must be an object")
    cls, checks = OPTIONS[op]
    merged = {**(defaults or {}), **options}
    unknown = set(merged) - set(checks)
    if unknown:
        raise invalid(f"unknown options {names(unknown)} for {op}; allowed: {sorted(checks)}")
    return cls(**{name: checks[name](value) for name, value in merged.items()})
