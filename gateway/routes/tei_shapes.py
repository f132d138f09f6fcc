"""The bodies of TEI's routes (`gateway.routes.tei`) read as Text Embeddings Inference reads
them (router/src/http/types.rs).

TEI's `inputs`: for /embed a string, a list of token ids, or a list of either (one input
each); for /predict a string, `[text]`, `[text, text]` (ONE pair), or a batch of those as
lists (`[["a"], ["b"]]`). A field TEI does not know is ignored, as its JSON reader does.
"""

from __future__ import annotations

from typing import Any

from gateway.edge.api_errors import invalid
from gateway.edge.compat_errors import empty_batch
from tasks.render import shown


def truncation_options(body: dict[str, Any]) -> dict[str, Any]:
    """`truncate` (left out: the model's default, true: TEI's --auto-truncate) and
    `truncation_direction`, which shoal has on the right only."""
    options: dict[str, Any] = {}
    truncate = body.get("truncate")
    if truncate is not None:
        if not isinstance(truncate, bool):
            raise invalid(f"'truncate' must be true or false, got {shown(truncate)}")
        options["truncate"] = truncate
    direction = body.get("truncation_direction")
    if direction not in (None, "Right", "right"):
        if direction in ("Left", "left"):
            raise invalid("truncation_direction 'Left' is not supported: shoal truncates a "
                          "text on the right (its end); send 'Right' or leave it out")
        raise invalid(f"'truncation_direction' must be 'Right' or 'Left', got {shown(direction)}")
    return options


PROMPTS = {"query": True, "document": False}  # prompt_name -> options.is_query


def prompt_options(prompt_name: Any) -> dict[str, Any]:
    """TEI's `prompt_name` as the task's `is_query` (left out: nothing, the entry's document
    prompt)."""
    if prompt_name is None:
        return {}
    if type(prompt_name) is not str or prompt_name not in PROMPTS:
        raise invalid(f"'prompt_name' must be one of {list(PROMPTS)} (the model entry's "
                      f"prompts), got {shown(prompt_name)}")
    return {"is_query": PROMPTS[prompt_name]}


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field; left out or null: `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be true or false, got {shown(value)}")
    return value


def _is_ids(value: Any) -> bool:
    return type(value) is list and bool(value) and all(type(v) is int for v in value)


def embed_items(value: Any) -> list[dict[str, Any]]:
    """TEI's /embed `inputs` as task items: texts and token-id sequences (`{"tokens"}`,
    whose ids the model's entry checks)."""
    if isinstance(value, str):
        return [{"text": value}]
    if type(value) is not list:
        raise invalid("'inputs' must be a string, a list of token ids, or a list of strings "
                      "and token-id lists")
    if not value:
        raise empty_batch("inputs")
    if _is_ids(value):
        return [{"tokens": value}]  # one input given as its token ids
    items: list[dict[str, Any]] = []
    for i, one in enumerate(value):
        if isinstance(one, str):
            items.append({"text": one})
        elif _is_ids(one):
            items.append({"tokens": one})
        else:
            raise invalid(f"inputs[{i}] is {shown(one)}: each input is a string or a "
                          "non-empty list of token ids")
    return items


_PAIR = ("shoal's classifiers take one text each, not a pair; TEI reads a list of two "
         "strings as ONE pair: send a batch as [[\"text\"], [\"text\"]]")


def predict_texts(value: Any) -> tuple[list[str], bool]:
    """TEI's /predict `inputs` as texts, and whether it was a batch (answered as a list of
    lists; a single input as one flat list)."""
    if isinstance(value, str):
        return [value], False
    if type(value) is not list:
        raise invalid("'inputs' must be a string, [text] or a batch [[text], [text], ...]")
    if not value:
        raise empty_batch("inputs")
    if isinstance(value[0], str):  # one sequence: [text] or [text, text]
        if len(value) == 1:
            return [value[0]], False
        if len(value) == 2 and isinstance(value[1], str):
            raise invalid(f"'inputs' is a pair of texts: {_PAIR}")
        raise invalid("'inputs' must be a string, [text] or a batch [[text], [text], ...]")
    texts = []
    for i, sequence in enumerate(value):
        if type(sequence) is not list or not 1 <= len(sequence) <= 2 or \
                not all(isinstance(text, str) for text in sequence):
            raise invalid(f"inputs[{i}] is {shown(sequence)}: each input of a batch is [text]")
        if len(sequence) == 2:
            raise invalid(f"inputs[{i}] is a pair of texts: {_PAIR}")
        texts.append(sequence[0])
    return texts, True
