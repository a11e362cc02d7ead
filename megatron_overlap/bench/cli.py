"""argparse value types shared by the launchers in `launch/` (each error names the value and
what was expected, and argparse turns it into a one-line usage error, exit status 2)."""

from __future__ import annotations

import argparse


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {minimum}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _integer(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return value
