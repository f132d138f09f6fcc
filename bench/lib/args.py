"""Argument types the benchmarks' command lines share."""

from __future__ import annotations

import argparse


def int_list(value: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {value!r}"
        ) from None
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return items


def parse_levels(spec: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]: client counts, each a whole number >= 1."""
    try:
        levels = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of whole numbers: {spec!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"client counts must be >= 1: {spec!r}")
    return levels
