"""Argument types the benchmarks' command lines share."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


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


def add_env(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str) -> None:
    """`--env NAME=VALUE`, repeatable: settings for the stack a benchmark starts."""
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help=help)


def env_of(pairs: Iterable[str]) -> dict[str, str]:
    """`--env`'s NAME=VALUE pairs as a mapping (a value may itself hold '=')."""
    return dict(pair.split("=", 1) for pair in pairs)
