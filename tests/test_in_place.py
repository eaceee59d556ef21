"""The compiled step updates its cache and state in place: every cache and state buffer is
donated and aliased to an output, and no program copies a whole layer of the cache.

Read from the executables XLA builds on this CPU (`Compiled.memory_analysis`, the optimized
HLO). The CPU's own paths run as they are (XLA's operations, the C++ layer kernel). The
Pallas kernel's path is checked with the kernel replaced by an opaque read-only call (a
`pure_callback`, as a GPU's Triton call or a TPU's Mosaic call is to XLA): its CPU stand-in,
the interpret mode, is a loop over mutable copies of its inputs and copies by construction.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.ragged_paged_attention as rpa
from cbjax.loading import load_model
from cbjax.runtime.engine import Engine
from cbjax.runtime.engine_config import EngineConfig
from cbjax.runtime.traced.step import ragged_step
from tests.tiers import sweep


def _opaque_kernel(q, k_pages, v_pages, kv_lens, tables, cu_q_lens, **_):
    """A read-only call XLA cannot see into, shaped like the kernel's result."""
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return jax.pure_callback(lambda *a: np.zeros(q.shape, q.dtype), out, q, k_pages, v_pages, kv_lens, tables,
                             cu_q_lens)


def whole_layer_copies(hlo: str, layer) -> list[str]:
    """The instructions of optimized HLO that copy an array of one cache layer's shape."""
    shape = f"{jnp.dtype(layer.dtype).name.replace('float', 'f')}[" \
            f"{','.join(map(str, layer.shape))}]"
    return [line.strip() for line in hlo.splitlines() if re.search(rf"= {re.escape(shape)}\{{[^}}]*\}} copy\(", line)]


def checked_programs(engine: Engine) -> list[tuple]:
    """The smallest, a middle and the largest token bucket of single steps, and the multi-step ones."""
    single = [p for p in engine.programs() if p[2] == 1]
    return sorted({single[0], single[len(single) // 2], single[-1]} | {p for p in engine.programs() if p[2] > 1})


CASES = {
    "slots-cpu-kernels": dict(kv_cache="slots", cpu_kernels="auto"),
    "paged-cpu-kernels-chunked": dict(kv_cache="paged", cpu_kernels="auto", merge_mode="chunked"),
    "slots-xla": dict(kv_cache="slots", cpu_kernels="off"),
    "paged-xla-chunked": dict(kv_cache="paged", cpu_kernels="off", merge_mode="chunked"),
    "slots-xla-bf16": dict(kv_cache="slots", cpu_kernels="off", dtype="bfloat16"),
    "slots-kernel": dict(kv_cache="slots", attention="pallas"),
    "paged-kernel-chunked": dict(kv_cache="paged", attention="pallas", merge_mode="chunked"),
}


@pytest.mark.parametrize("case", sweep(sorted(CASES), quick={"slots-cpu-kernels", "paged-cpu-kernels-chunked",
                                                            "paged-xla-chunked"}))
def test_every_step_updates_its_cache_and_state_in_place(case, monkeypatch):
    options = dict(CASES[case])
    dtype = options.pop("dtype", "float32")
    if options.get("attention") == "pallas":
        monkeypatch.setattr(rpa, "ragged_paged_attention", _opaque_kernel)
    model = load_model("tiny-llama", dtype=dtype)
    steps = 1 if options.get("merge_mode") == "chunked" else 2
    engine = Engine(model, EngineConfig(num_slots=4, max_seq_len=64, page_size=16, decode_steps=steps, **options))
    donated = sum(a.nbytes for a in jax.tree.leaves((engine.cache, engine.state)))
    layer = engine.cache.k[0]
    for program in checked_programs(engine):
        args, static = engine.padding_arguments(program[1], program[2])
        compiled = ragged_step.trace(*args, **static).lower().compile()
        where = f"{case} {program}"
        assert compiled.memory_analysis().alias_size_in_bytes == donated, where
        assert whole_layer_copies(compiled.as_text(), layer) == [], where


def test_the_copy_check_sees_a_copy():
    """The check itself: a program that keeps the old cache beside the new one must copy."""
    layer = jnp.zeros((2, 4, 64, 16), jnp.float32)

    @jax.jit
    def keeps_both(cache):
        return cache.at[:, 0, 0].set(1.0), cache

    assert whole_layer_copies(keeps_both.lower(layer).compile().as_text(), layer)
