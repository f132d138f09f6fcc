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
