"""The suite's two tiers.

The quick run, the README's test command (`python -m pytest -q -m "not slow"`), checks every
behaviour on representative cases: each family's model against transformers, each scheduling
policy, layout, merge mode and kernel path on one or two families, each script's flags. The slow
tier (`-m slow`) repeats those checks over every family, layout and kernel mode, and runs the
experiment scripts and the multi-process setups end to end. `.ci/run` runs both, the quick run
first. A test goes slow when the quick run already makes its check on another case; its tier is
said where it is parametrized or defined, never in a list elsewhere.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import pytest

slow = pytest.mark.slow


def sweep(cases: Iterable, quick: Collection, ids=None) -> list:
    """`cases` as pytest parameters for `parametrize`: those in `quick` unmarked (the quick
    run takes them), the others marked slow; a quick case that is not among `cases` is an
    error. A case of several arguments is a tuple (as `parametrize` takes it); `ids`, when
    given, name the cases in order."""
    cases = list(cases)
    names = list(ids) if ids is not None else [None] * len(cases)
    params = []
    for case, name in zip(cases, names, strict=True):
        values = case if isinstance(case, tuple) else (case,)
        params.append(pytest.param(*values, id=name, marks=() if case in quick else slow))
    missing = [case for case in quick if case not in cases]
    if missing:
        raise ValueError(f"quick cases {missing} are not among the cases")
    return params
