"""A knob is declared once: its default, help and bounds live in the lowest config that
uses it, and the others (`EngineConfig`, `EngineArgs`) take it from there."""

import dataclasses

import pytest

from cbjax import EngineArgs, knobs
from cbjax.runtime.engine_config import EngineConfig
from cbjax.scheduling.config import SchedulerConfig

CONFIGS = (SchedulerConfig, EngineConfig, EngineArgs)
# EngineArgs means something narrower by this one: speculation is on or off by its method.
NARROWED = {"num_speculative_tokens"}


def fields(config) -> dict:
    return {f.name: f for f in dataclasses.fields(config)}


def test_every_config_field_is_a_declared_knob():
    for config in CONFIGS:
        bare = [name for name, f in fields(config).items() if "help" not in f.metadata]
        assert bare == [], f"{config.__name__}: fields without a knob declaration"


@pytest.mark.parametrize("lower,upper", [(SchedulerConfig, EngineConfig), (SchedulerConfig, EngineArgs),
                                         (EngineConfig, EngineArgs)])
def test_a_shared_knob_has_one_default_help_and_bounds(lower, upper):
    below, above = fields(lower), fields(upper)
    for name in sorted(set(below) & set(above) - NARROWED):
        assert below[name].default == above[name].default, name
        assert dict(below[name].metadata) == dict(above[name].metadata), name


def out_of_bounds(f):
    meta = f.metadata
    if meta["choices"] is not None:
        return "no-such-choice"
    if meta["lower"] is not None:
        return meta["lower"] - 1
    if meta["upper"] is not None:
        return meta["upper"] + 1
    return None


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_bounded_knob_refuses_a_value_outside_its_declaration(config):
    for name, f in fields(config).items():
        bad = out_of_bounds(f)
        if bad is None:
            continue
        with pytest.raises(ValueError, match=name):
            knobs.check(_with(config, name, bad))


def _with(config, name, value):
    """A config object with every knob at its default and `name` at `value`, not checked yet."""
    obj = object.__new__(config)
    for f in dataclasses.fields(config):
        setattr(obj, f.name, f.default)
    setattr(obj, name, value)
    return obj


def test_a_bool_knob_refuses_a_number():
    with pytest.raises(ValueError, match="length_aware must be a bool"):
        SchedulerConfig(length_aware=1)
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        EngineArgs(enable_prefix_caching="yes")
