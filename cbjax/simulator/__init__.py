"""A scheduling simulator: the real `LLM` and `Scheduler` over an engine that computes
nothing and charges each call its modelled cost on a simulated clock.

    llm = LLM("opt-13b", simulate="a100-40gb", kv_cache="paged", kv_cache_bytes=...)
    llm = LLM("smollm2-135m", simulate="configs/sim_cpu_smollm2.json")   # calibrated here

`simulate` is an accelerator name (roofline, hardware.ACCELERATORS) or a calibration
file written by experiments/studies/calibrate_simulator.py (cost_model.CalibratedCost).
"""

from __future__ import annotations

from cbjax.simulator.cost_model import CalibratedCost, Call, RooflineCost, kv_transfer_cost, load_cost_model
from cbjax.simulator.hardware import ACCELERATORS, MODEL_SHAPES, Accelerator
from cbjax.simulator.sim_engine import LaneClock, SimClock, SimulatedEngine

__all__ = ["ACCELERATORS", "MODEL_SHAPES", "Accelerator", "CalibratedCost", "Call", "LaneClock", "RooflineCost",
           "SimClock", "SimulatedEngine", "kv_transfer_cost", "load_cost_model", "model_for_simulation"]


def model_for_simulation(spec: str, dtype: str = "bfloat16"):
    """A model to simulate: a shape from MODEL_SHAPES (no weights), or anything
    `load_model` reads (its weights are loaded but never used)."""
    from cbjax.loading import Model, load_model

    if spec in MODEL_SHAPES:
        return Model(MODEL_SHAPES[spec], params=None, tokenizer=None, source=f"shape:{spec}")
    return load_model(spec, dtype=dtype)
