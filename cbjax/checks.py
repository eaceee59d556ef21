"""Argument checks shared by the user-facing entry points.

Every value a user hands in is checked where it enters (`SamplingParams`,
`LLM.add_request`, the configs), so that a bad one is a `ValueError` naming the
argument there, never an error in a later step that would stall other requests.
Device arrays are int32 and float32: anything that does not fit them is refused.
"""

from __future__ import annotations

import math
import numbers
import operator

INT32_MAX = 2 ** 31 - 1
FLOAT32_MAX = 3.4028234663852886e38


def integer(name: str, value, low: int | None = None, high: int = INT32_MAX) -> int:
    """`value` as a Python int in [low, high]; numpy integers pass, bools and floats do not."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if (low is not None and out < low) or out > high:
        lo = "-inf" if low is None else low
        raise ValueError(f"{name} must be an integer in [{lo}, {high}], got {value!r}")
    return out


def real(name: str, value, low: float = -FLOAT32_MAX, high: float = FLOAT32_MAX, *,
         low_open: bool = False) -> float:
    """`value` as a finite Python float in [low, high] (or (low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    out = float(value)
    too_low = out <= low if low_open else out < low
    if not math.isfinite(out) or too_low or out > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a finite number in {bracket}{low}, {high}], got {value!r}")
    return out
