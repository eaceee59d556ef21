"""A knob: a config field declared once with its default, help, choices and bounds.

The scheduler's config, the device engine's config and `EngineArgs` (the user's knobs,
and the absl flags made from them) share many knobs. Each is declared in the lowest
config that uses it (`knob`), the others take it from there (`like`), and one `check`
refuses a bad value from any of them, so a knob's default and bounds are typed once.
"""

from __future__ import annotations

import dataclasses

from cbjax import checks


def knob(default, help: str, choices=None, lower=None, upper=None, low_open: bool = False):
    """A dataclass field that `check` and `EngineArgs.define_flags` read. `lower`/`upper`:
    the bounds of a number (`low_open`: `lower` itself refused); `choices`: the values a
    string may take. A default of None means "derived" and is always allowed."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "lower": lower,
                                                        "upper": upper, "low_open": low_open})


def like(config: type, name: str, **changes):
    """The knob `name` of `config`, declared there; `changes` overrides its default, help or
    bounds where this config means something narrower."""
    f = {f.name: f for f in dataclasses.fields(config)}[name]
    meta = {**f.metadata, **{k: v for k, v in changes.items() if k != "default"}}
    return dataclasses.field(default=changes.get("default", f.default), metadata=meta)


def check(config) -> None:
    """Refuse (ValueError naming the knob) any value of `config`'s knobs outside its
    declaration; numbers are normalized to Python ints and floats."""
    for f in dataclasses.fields(config):
        meta, value = f.metadata, getattr(config, f.name)
        if "help" not in meta or (value is None and f.default is None):
            continue
        kind = (f.type if isinstance(f.type, str) else f.type.__name__).split(" |")[0]
        if meta["choices"] is not None:
            if value not in meta["choices"]:
                raise checks.FieldError(f"{f.name} must be one of {tuple(meta['choices'])}, got {value!r}", f.name)
        elif kind == "bool":
            if not isinstance(value, bool):
                raise checks.FieldError(f"{f.name} must be a bool, got {value!r}", f.name)
        elif kind == "int":
            upper = checks.INT32_MAX if meta["upper"] is None else meta["upper"]
            setattr(config, f.name, checks.integer(f.name, value, meta["lower"], upper))
        elif kind == "float":
            lower = -checks.FLOAT32_MAX if meta["lower"] is None else meta["lower"]
            upper = checks.FLOAT32_MAX if meta["upper"] is None else meta["upper"]
            setattr(config, f.name, checks.real(f.name, value, lower, upper, low_open=meta["low_open"]))
