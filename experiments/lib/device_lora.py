"""bench_device.py's `lora` section: an 8B decode step with LoRA adapters in the batch.

Llama-3-8B's shape in bf16 and rank-16 adapters on q_proj and v_proj: one random adapter in PEFT's
format, written once and loaded under 64 names (64 slots of the pool, each read apart, as 64
distinct adapters would be). At each of --batches: the engine without LoRA, every row on one
adapter, and the rows over the 64 adapters in turn (min(batch, 64) distinct). Each row gives ms per
step, the ratio to the engine without LoRA, and the adapters' bytes a step reads over the copy
bandwidth (what reading them costs at the roofline).
"""

from __future__ import annotations

import gc
import os
import tempfile

from experiments.lib.device_common import LLAMA3_8B, TINY, batches, budget, build_engine, decode_ms, decode_shape, \
    device_model

RANK, TARGETS = 16, ("q_proj", "v_proj")


def lora_decode(copy_GBps: float, tiny: bool) -> dict:
    from cbjax.experimental import activation_dtype, adapter_bytes, write_random_adapter

    model = device_model(TINY if tiny else LLAMA3_8B)
    c = model.config
    count = 4 if tiny else 64
    prompt_len, warm, timed = decode_shape()
    max_len = budget(prompt_len, warm, timed, 1)
    path = write_random_adapter(os.path.join(tempfile.mkdtemp(prefix="cbjax-device-lora-"), "adapter"), c, RANK,
                                TARGETS)
    one_adapter = adapter_bytes(c, RANK, TARGETS, activation_dtype(model.params).itemsize)
    base, base_startup = build_engine(model, "paged", "auto", max(batches()), max_len)
    base_ms = {batch: decode_ms(base, batch, prompt_len, warm, timed) for batch in batches()}
    del base
    gc.collect()
    llm, startup = build_engine(model, "paged", "auto", max(batches()), max_len, enable_lora=True, max_loras=count,
                                max_cpu_loras=count, max_lora_rank=RANK, lora_target_modules=",".join(TARGETS))
    names = [f"a{i}" for i in range(count)]
    for name in names:
        llm.load_lora(name, path)
    rows = {}
    for batch in batches():
        one = decode_ms(llm, batch, prompt_len, warm, timed, loras=names[:1])
        many = decode_ms(llm, batch, prompt_len, warm, timed, loras=names)
        distinct = min(batch, count)
        rows[batch] = {"base_ms": base_ms[batch], "one_ms": one, "many_ms": many, "distinct": distinct,
                       "adapter_MB": distinct * one_adapter / 1e6,
                       "adapter_floor_ms": distinct * one_adapter / copy_GBps / 1e6}
    return {"startup_s": startup, "base_startup_s": base_startup, "adapters": count, "steps": rows}


def lora_lines(results: dict, line) -> None:
    """The section's lines of bench_device's table."""
    r = results.get("lora")
    if not r:
        return
    line("lora", "start-up with the pool (without)", f"{r['startup_s']:.1f} s ({r['base_startup_s']:.1f} s)")
    for batch, s in r["steps"].items():
        line("lora", f"batch {batch}, 1 adapter", f"{s['one_ms']:.2f} ms ({s['one_ms'] / s['base_ms']:.2f}x no LoRA)")
        line("lora", f"batch {batch}, {s['distinct']} adapters",
             f"{s['many_ms']:.2f} ms ({s['many_ms'] / s['base_ms']:.2f}x, reads {s['adapter_MB']:.0f} MB: "
             f"{s['adapter_floor_ms']:.2f} ms)")
