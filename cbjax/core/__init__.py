"""The engine core: `EngineArgs` (every knob, checked once), `build_core` (args to a running
core), `EngineCore` (one scheduling round, with the hooks other fronts use), the shared
arrival loop (`replay.run_arrivals`) and `StepStats`."""

from cbjax.core.builder import build_core
from cbjax.core.engine_args import EngineArgs
from cbjax.core.engine_core import EngineCore
from cbjax.core.step_stats import Load, StepStats

__all__ = ["EngineArgs", "EngineCore", "Load", "StepStats", "build_core"]
