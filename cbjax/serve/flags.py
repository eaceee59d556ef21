"""The engine's absl flags, shared by `python -m cbjax.serve` and experiments/serve_bench.py
(which starts the server with the same options it replays in process). Each flag is an
`EngineArgs` field: its name, default, bounds and help are defined there."""

from __future__ import annotations

from cbjax.core import EngineArgs

ENGINE_FLAGS = ("policy", "num_slots", "max_seq_len", "window_ms", "refill_interval", "kv_cache", "page_size",
                "num_pages", "enable_prefix_caching", "merge_mode", "max_num_batched_tokens", "max_step_tokens",
                "attention", "dtype",
                "ordering", "score_wait", "score_short", "score_priority", "priority_preemption", "length_predictor",
                "prefill_instances", "decode_instances", "prefill_tensor_parallel", "decode_tensor_parallel")


def define_engine_flags(num_slots: int = 8, max_seq_len: int = 512) -> None:
    EngineArgs.define_flags(ENGINE_FLAGS, num_slots=num_slots, max_seq_len=max_seq_len)


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
