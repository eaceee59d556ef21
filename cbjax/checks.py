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


class FieldError(ValueError):
    """A ValueError about one argument, `field` its name (the server's error body names it)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _field(name: str, field: str | None) -> str | None:
    return field if field is not None else (name if name.isidentifier() else None)


def integer(name: str, value, low: int | None = None, high: int = INT32_MAX, *, field: str | None = None) -> int:
    """`value` as a Python int in [low, high]; numpy integers pass, bools and floats do not.
    `field`: the argument's name when `name` is a phrase (default: `name` if it is one)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise FieldError(f"{name} must be an integer, got {value!r}", _field(name, field))
    try:
        out = operator.index(value)
    except TypeError:
        raise FieldError(f"{name} must be an integer, got {value!r}", _field(name, field)) from None
    if (low is not None and out < low) or out > high:
        lo = "-inf" if low is None else low
        raise FieldError(f"{name} must be an integer in [{lo}, {high}], got {value!r}", _field(name, field))
    return out


def real(name: str, value, low: float = -FLOAT32_MAX, high: float = FLOAT32_MAX, *,
         low_open: bool = False, field: str | None = None) -> float:
    """`value` as a finite Python float in [low, high] (or (low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldError(f"{name} must be a number, got {value!r}", _field(name, field))
    out = float(value)
    too_low = out <= low if low_open else out < low
    if not math.isfinite(out) or too_low or out > high:
        bracket = "(" if low_open else "["
        raise FieldError(f"{name} must be a finite number in {bracket}{low}, {high}], got {value!r}",
                         _field(name, field))
    return out
