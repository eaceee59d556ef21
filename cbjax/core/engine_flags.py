"""The engine's absl flags, shared by `python -m cbjax.serve` and the benchmarks that start a
server with the same options they replay in process (experiments/benchmarks/serve_bench.py). Every `EngineArgs`
field is a flag, its name, default, bounds and help defined there; `seed` is left to each
script (the server's is the engine's, serve_bench's seeds its workload)."""

from __future__ import annotations

import dataclasses

from cbjax.core import engine_args as engine_args_module
from cbjax.core.engine_args import EngineArgs

ENGINE_FLAGS = tuple(f.name for f in dataclasses.fields(EngineArgs) if f.name != "seed")


def define_engine_flags(num_slots: int = 8, max_seq_len: int = 512) -> None:
    """Define them; a script lists them in its --help with `flags.adopt_module_key_flags` of
    this module."""
    from absl import flags

    EngineArgs.define_flags(ENGINE_FLAGS, num_slots=num_slots, max_seq_len=max_seq_len)
    flags.adopt_module_key_flags(engine_args_module)


def engine_args(**overrides) -> EngineArgs:
    """The `EngineArgs` the engine flags (and `overrides`) ask for."""
    return EngineArgs.from_flags(ENGINE_FLAGS, **overrides)


def engine_options() -> dict:
    """The engine flags' values, as `LLM(...)` keyword arguments (and for the JSON record)."""
    from absl import flags

    return {name: flags.FLAGS[name].value for name in ENGINE_FLAGS}


def engine_argv() -> list[str]:
    """The engine flags as command-line arguments (to start a server with them)."""
    return EngineArgs.flags_argv(ENGINE_FLAGS)
