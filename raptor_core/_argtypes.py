"""Checked ``argparse`` types for the ``raptor`` command line.

A value out of range is a usage error that argparse reports in one line with exit status 2,
before any work starts, instead of a traceback from deep inside a library (``--seed -1``
used to reach numpy).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["MAX_SEED", "finite_float", "int_range", "positive_float"]

#: numpy's seeds are 32-bit unsigned integers.
MAX_SEED = 2**32 - 1


def int_range(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            msg = f"expected an integer, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            msg = f"expected an integer {bound}, got {value}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def finite_float(text: str) -> float:
    """An argparse type: a finite number (no ``nan``/``inf``)."""
    try:
        value = float(text)
    except ValueError:
        msg = f"expected a number, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not math.isfinite(value):
        msg = f"expected a finite number, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, for example)."""
    value = finite_float(text)
    if value <= 0:
        msg = f"expected a number > 0, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value
