"""OpenAI's `input` (POST /v1/embeddings) and `prompt` (POST /v1/completions) as task items.

OpenAI's API takes a string, a list of strings, one token-id sequence (a list of integers)
or a list of them, and refuses empty strings, empty lists and a list that mixes strings
with token ids. Strings become `{"text": ...}` items and token-id sequences
`{"tokens": [...]}` items (`tasks.schema`: the model's own input ids, checked against its
vocabulary where it runs). Whether the model takes token ids at all is its catalog entry's
to say when the items are parsed (`ModelEntry.parse`).
"""

from __future__ import annotations

from typing import Any

from gateway.edge.api_errors import invalid
from tasks.schema import check_token_ids

_SHAPES = ("a string, a list of strings, a list of token ids (integers) or a list of lists "
           "of token ids")


def openai_input_items(value: Any, field: str = "input") -> list[dict[str, Any]]:
    """The task items of an OpenAI `input` (or `prompt`: `field`) value; VALIDATION_ERROR,
    naming the index, for what OpenAI's API refuses: an empty string or list, a mix of
    strings and token ids, an id that is no integer from 0."""
    if type(value) is str:
        if not value:
            raise invalid(f"'{field}' is an empty string; send at least one character")
        return [{"text": value}]
    if type(value) is not list:
        raise invalid(f"'{field}' must be {_SHAPES}")
    if not value:
        raise invalid(f"'{field}' is an empty list; send {_SHAPES}")
    # Strings first, with nothing else built on the way: most requests are these.
    if all(type(v) is str for v in value):
        if "" in value:
            raise invalid(f"{field}[{value.index('')}] is an empty string; send at least one "
                          "character")
        return [{"text": v} for v in value]
    first = value[0]
    if type(first) is list:  # token-id sequences, one per item
        for i, ids in enumerate(value):
            check_token_ids(ids, f"{field}[{i}]")
        return [{"tokens": ids} for ids in value]
    if type(first) is not str:  # one token-id sequence
        check_token_ids(value, field)
        return [{"tokens": value}]
    bad = next(i for i, v in enumerate(value) if type(v) is not str)
    raise invalid(f"{field}[{bad}] is not a string: '{field}' must be {_SHAPES}, not a mix "
                  "of them")
