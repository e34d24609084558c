"""argparse value types shared by the subcommands, so bad numbers fail at parse time with usage."""

from __future__ import annotations

import argparse


def _bounded(convert, accept, requirement: str):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value

    return parse


positive_int = _bounded(int, lambda value: value >= 1, "at least 1")
non_negative_int = _bounded(int, lambda value: value >= 0, "at least 0")
positive_float = _bounded(float, lambda value: value > 0, "positive")
probability = _bounded(float, lambda value: 0 < value <= 1, "above 0 and at most 1")


def positive_ints(text: str) -> list[int]:
    """Positive integers, comma-separated: `1,4,8`."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,4,8, got {text!r}")
    return values
