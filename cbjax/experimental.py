"""What studies, benchmarks and the server use beyond the public API (`cbjax`): the internals a
study of the engine, the scheduler or the simulator builds for itself. One table, name ->
where it lives; each is imported on first use (`from cbjax.experimental import X`), so a
script pays only for what it asks for. Unstable: a name moves when the code does.

experiments/ import only `cbjax` and this module, and the server only these and its own
modules (tests/test_public_api.py holds both, by AST).
"""

from __future__ import annotations

import importlib

# name -> "module" (the module's attribute of that name), "module:attribute" (another name
# there), or "module:" (the module itself).
_WHERE = {
    # models
    "KV_DTYPES": "cbjax.models.kv_cache",
    "PagedCache": "cbjax.models.kv_cache",
    "SlotCache": "cbjax.models.kv_cache",
    "activation_dtype": "cbjax.models.quant",
    "attention_part": "cbjax.models.attention",
    "dense": "cbjax.models.layers",
    "init_params": "cbjax.models.params",
    "init_params_on_device": "cbjax.models.params",
    "kv_storage_dtype": "cbjax.models.kv_cache",
    "length_predictor": "cbjax.models.length_predictor:",  # the module itself
    "merge_parts": "cbjax.models.attention",
    "mlp": "cbjax.models.layers",
    "norm": "cbjax.models.layers",
    "qkv_projections": "cbjax.models.transformer",
    "quant": "cbjax.models.quant:",  # the module itself
    "rope_inv_freq": "cbjax.models.layers",
    "rope_tables": "cbjax.models.layers",
    "visible": "cbjax.models.attention",
    # loading
    "Model": "cbjax.loading",
    "PRESETS": "cbjax.loading.presets",
    "RANDOM_PRESETS": "cbjax.loading.presets",
    "is_orbax_dir": "cbjax.loading",
    "load_hf_dir": "cbjax.loading",
    "load_model": "cbjax.loading",
    "write_random_adapter": "cbjax.loading.peft",
    "adapter_bytes": "cbjax.models.lora",
    "load_preset": "cbjax.loading.presets",
    "smollm2_gguf_path": "cbjax.loading.presets",
    # config
    "ModelConfig": "cbjax.config",
    # runtime
    "Engine": "cbjax.runtime.engine",
    "EngineConfig": "cbjax.runtime.engine",
    "bubble_fraction": "cbjax.runtime.scale.pipeline",
    "default_cache": "cbjax.runtime.compiled.kernel_tuning",
    "kernels": "cbjax.runtime.cpu.kernels:",  # the module itself
    "link_bytes_per_layer": "cbjax.runtime.scale.expert_parallel",
    "padded_length": "cbjax.runtime.kv_transfer",
    "split_logprobs": "cbjax.runtime.packing",
    "LARGE_CHUNK": "cbjax.runtime.prompt_logprobs",
    "SMALL_CHUNK": "cbjax.runtime.prompt_logprobs",
    # scheduling
    "PrefixIndex": "cbjax.scheduling.prefix_index",
    "Row": "cbjax.scheduling.plan",
    # simulator
    "ACCELERATORS": "cbjax.simulator",
    "CalibratedCost": "cbjax.simulator",
    "Call": "cbjax.simulator",
    "DTYPE_BYTES": "cbjax.simulator.hardware",
    "FIT_PARAMETERS": "cbjax.simulator.published",
    "MODEL_SHAPES": "cbjax.simulator",
    "RooflineCost": "cbjax.simulator",
    "calibrate": "cbjax.simulator.profile",
    "causal_pairs": "cbjax.simulator.sim_engine",
    "fit_published": "cbjax.simulator.published:fit",
    "kv_bytes_per_token": "cbjax.simulator.hardware",
    "load_cost_model": "cbjax.simulator",
    "load_published": "cbjax.simulator.published:load",
    "measure_host_costs": "cbjax.simulator.profile",
    "model_for_simulation": "cbjax.simulator",
    "profile": "cbjax.simulator.profile:",  # the module itself
    "profile_rounds": "cbjax.simulator.profile",
    "simulate_published": "cbjax.simulator.published:simulate",
    "weight_bytes": "cbjax.simulator.hardware",
    # core
    "engine_args": "cbjax.core.engine_args:",  # the module itself
    "engine_flags": "cbjax.core.engine_flags:",  # the module itself
    "define_engine_flags": "cbjax.core.engine_flags",
    "engine_args_from_flags": "cbjax.core.engine_flags:engine_args",
    "engine_argv": "cbjax.core.engine_flags",
    "engine_options": "cbjax.core.engine_flags",
    "quantized": "cbjax.core.builder",
    # parallel
    "distributed": "cbjax.parallel.distributed:",  # the module itself
    "expose_host_devices": "cbjax.parallel.distributed",
    # workload
    "LengthDist": "cbjax.workload",
    "PROFILES": "cbjax.workload",
    "WorkloadRequest": "cbjax.workload",
    "arrival_times": "cbjax.workload",
    "chat": "cbjax.workload",
    "chat_messages": "cbjax.workload",
    "profile_workload": "cbjax.workload",
    "random_json_schema": "cbjax.workload",
    "recorded_lengths": "cbjax.workload",
    "synthetic": "cbjax.workload",
    # traces
    "TRACES": "cbjax.traces",
    "sharegpt_conversations": "cbjax.traces",
    "sharegpt_workload": "cbjax.traces",
    "trace_workload": "cbjax.traces",
    "traces": "cbjax.traces:",  # the module itself
    # metrics
    "RequestTimes": "cbjax.metrics",
    "SLO": "cbjax.metrics",
    "find_capacity": "cbjax.metrics",
    "machine_info": "cbjax.metrics",
    "summarize": "cbjax.metrics",
    "summarize_outputs": "cbjax.metrics",
    "write_json": "cbjax.metrics",
    # perplexity
    # tokenization
    "chat_prompt_ids": "cbjax.tokenization",
    # shipped_predictors
    "predictor_dir": "cbjax.shipped_predictors",
    # compile_cache
    "compile_cache": "cbjax.compile_cache:",  # the module itself
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    try:
        where = _WHERE[name]
    except KeyError:
        raise AttributeError(f"cbjax.experimental has no {name!r}: add it to the table, naming where it lives") from None
    module, colon, attribute = where.partition(":")
    value = importlib.import_module(module)
    if not colon or attribute:
        value = getattr(value, attribute or name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return __all__
