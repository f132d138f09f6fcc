"""Callers' values and keys rendered safely into error messages.

A request body is anything msgpack or JSON can hold: a map with both `str` and
`bytes` keys (which `sorted()` cannot order), values nested a thousand deep
(which `repr()` cannot render without RecursionError), strings of megabytes. An
error message that names such a value must still be built, and stay short.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from typing import Any


class _Repr(reprlib.Repr):
    def repr_bytes(self, value: bytes, level: int) -> str:
        # reprlib renders bytes whole before cutting; cut first (a body may hold megabytes).
        cut = value[:self.maxstring]
        return repr(cut) + ("..." if len(value) > len(cut) else "")


_REPR = _Repr()
_REPR.maxlevel = 3  # nesting shown before "..."; reprlib recurses no deeper
_REPR.maxstring = 80
_REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_MAX_NAMES = 16


def shown(value: Any) -> str:
    """A caller's value as a short repr: bounded in depth, length and items."""
    try:
        return _REPR.repr(value)
    except Exception:  # a type whose repr fails: name it instead
        return f"<{type(value).__name__}>"


def names(keys: Iterable[Any]) -> str:
    """Keys (of mixed types) as a sorted, bounded list: `['a', 'b', b'c']`."""
    rendered = sorted(shown(key) for key in keys)
    more = len(rendered) - _MAX_NAMES
    listed = ", ".join(rendered[:_MAX_NAMES]) + (f", ... ({more} more)" if more > 0 else "")
    return f"[{listed}]"
