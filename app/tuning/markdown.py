"""Markdown tables, as every benchmark and `shoal bench` print them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def fmt(value: Any, spec: str = ".1f", missing: str = "n/a") -> str:
    """A cell: `value` formatted by `spec`; `missing` for None or NaN."""
    if value is None or (isinstance(value, float) and value != value):
        return missing
    return format(value, spec)


def dash(value: Any, spec: str = ".1f") -> str:
    """A cell: `value` formatted by `spec`; "-" for None or NaN."""
    return fmt(value, spec, missing="-")


def row(cells: Iterable[Any]) -> str:
    """One table row: `| a | b |` (cells as str() gives them; an empty one `|  |`)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: Sequence[Any], rows: Iterable[Iterable[Any]] = (),
          align: str | None = None) -> list[str]:
    """The lines of a markdown table: `head`, the rule, then `rows`.

    `align` has one letter per column, "l" (`---`) or "r" (`---:`); default: all right,
    as numbers are."""
    align = "r" * len(head) if align is None else align
    if len(align) != len(head) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r} does not fit {len(head)} columns")
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return [row(head), rule, *(row(r) for r in rows)]
