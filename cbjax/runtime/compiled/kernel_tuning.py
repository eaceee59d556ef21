"""The Pallas kernels' launch settings tuned on an engine's own shapes, at its warm-up on a GPU.

Each program the engine will compile is traced once while `pallas_kernels.tuning` records the
kernel calls in it (kernel, shape, arguments as shapes); for each call not yet in the cache,
every candidate of that kernel's space (`decode_matmul.candidates`, and XLA's own product for
a matmul; `ragged_paged_attention.candidates`) runs on random arguments of those shapes and
is timed, the fastest is kept and written to the cache, keyed by device kind, JAX version
and shape. The programs are then compiled with the choices (the jit caches are dropped after
the recording trace, so nothing traced before the choice survives). A second start reads the
choices and times nothing. `bench_device.py` prints them (`EngineInfo` carries them).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cbjax import compile_cache
from cbjax.models import quant
from cbjax.models.ops import XLA
from cbjax.runtime.engine_ops import DecodeMatmulOps
from pallas_kernels import decode_matmul as matmul_kernel
from pallas_kernels import ragged_paged_attention as attention_kernel
from pallas_kernels import tuning

BUDGET_S = 120.0  # past this, the shapes not yet tuned keep their defaults (and are tried next start)


def wanted(engine) -> bool:
    """Whether `engine`'s warm-up tunes: config.kernel_tuning "auto" on a GPU whose programs hold a
    Pallas kernel (the attention kernel, or the decode matmul's ops)."""
    return (engine.config.kernel_tuning == "auto" and engine.platform == "gpu"
            and (engine.attention == "pallas" or isinstance(engine.ops, DecodeMatmulOps)))


def default_cache() -> tuning.TuningCache:
    return tuning.TuningCache(compile_cache.cache_root() / tuning.FILE_NAME)


def kernel_calls(engine) -> dict[tuple, object]:
    """`{(kernel, shape): example}` of every Pallas kernel call in the programs `engine` compiles."""
    from cbjax.runtime.traced.step import ragged_step

    jax.clear_caches()  # a program traced earlier in this process would be reused, unrecorded
    with tuning.recording() as calls:
        for kind, num_tokens, steps in engine.programs():
            args, static = engine.padding_arguments(num_tokens, steps,
                                                    verify=engine.verify_positions if kind == "verify" else 0)
            ragged_step.trace(*args, **static)
    return dict(calls)


def _random_like(spec, key):
    if jnp.issubdtype(spec.dtype, jnp.integer):
        return jax.random.randint(key, spec.shape, -100, 100).astype(spec.dtype)
    return (jax.random.uniform(key, spec.shape, minval=0.5, maxval=1.0) * 0.1).astype(spec.dtype)


def _random_tree(tree, seed: int):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    return jax.tree.unflatten(treedef, [_random_like(leaf, k) for leaf, k in zip(leaves, keys)])


def matmul_runs(shape: tuple, example, interpret: bool) -> dict[str, Callable[[], object]]:
    """XLA's product (what the engine runs without the kernel) and each launch of the kernel's
    space for `shape` (`decode_matmul.shape_of`: rows, out, in, groups, dtype), on random
    arguments of `example`'s shapes."""
    x, values, scale = _random_tree(example, seed=0)
    weight = quant.QuantizedWeight(values, scale) if scale is not None else values
    xla = jax.jit(XLA.dense)  # once: a new jit a call would compile every call
    runs = {"xla": lambda: xla(x, weight)}
    for launch in matmul_kernel.candidates(shape[0], groups=shape[3]):
        runs[launch.name] = (lambda launch=launch: matmul_kernel.decode_matmul(x, values, scale, launch=launch,
                                                                                interpret=interpret))
    return runs


def attention_arguments(example) -> tuple:
    """Arguments of an attention call's shapes: its rows spread over its sequences, each at the
    longest context its page table holds (the case split-KV is for), pages distinct where the
    pool allows. A decode call's (no `cu_q_lens`) stays one."""
    (q, k_pages, v_pages, kv_lens, tables, cu), _ = example
    q, k_pages, v_pages = _random_tree((q, k_pages, v_pages), seed=1)
    seqs, pages_per_seq = tables.shape
    values = k_pages.values if hasattr(k_pages, "scale") else k_pages
    num_pages, page_size = values.shape[1], values.shape[2]
    rows = q.shape[0]
    q_lens = np.array([rows // seqs + (s < rows % seqs) for s in range(seqs)], np.int32)
    context = min(pages_per_seq, num_pages) * page_size
    lens = np.maximum(q_lens, context).astype(np.int32)
    table = (np.arange(seqs)[:, None] * pages_per_seq + np.arange(pages_per_seq)[None, :]) % num_pages
    cu_q_lens = None if cu is None else jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, k_pages, v_pages, jnp.asarray(lens), jnp.asarray(table, jnp.int32), cu_q_lens


def attention_runs(shape: tuple, example, interpret: bool) -> dict[str, Callable[[], object]]:
    """Each launch of the attention kernel's space for `shape` (`ragged_paged_attention.shape_of`:
    rows, heads, KV heads, head_dim, page size, pages a sequence, ...: the Triton launches, and
    the Mosaic GPU ones where that form takes the call) on `attention_arguments`."""
    arrays, static = attention_arguments(example), example[1]
    runs = {}
    for launch in attention_kernel.candidates_of(shape):
        # Every setting named (kv_splits at least): the call must not read the tuned choice.
        settings = {**dataclasses.asdict(launch), "kv_splits": launch.kv_splits or 1}
        runs[launch.name] = (lambda settings=settings: attention_kernel.ragged_paged_attention(
            *arrays, **static, interpret=interpret, **settings))
    return runs


RUNS = {matmul_kernel.KERNEL: matmul_runs, attention_kernel.KERNEL: attention_runs}


def tune_kernels(engine, *, cache: tuning.TuningCache | None = None, device_kind: str | None = None,
                 timer: Callable[[str, Callable[[], object]], float] | None = None, interpret: bool = False,
                 budget_s: float = BUDGET_S) -> dict[tuple, str]:
    """Choose a launch for every Pallas kernel call in `engine`'s programs (module docstring):
    `{(kernel, shape): candidate name}`. `cache`: default the file beside the compilation cache;
    `device_kind`: default the engine's device's; `timer(name, run)`: default `tuning.time_call`;
    `interpret`: run the candidates in Pallas interpret mode (a CPU checking the machinery)."""
    cache = cache or default_cache()
    device_kind = device_kind or jax.devices()[0].device_kind
    deadline = time.perf_counter() + budget_s
    choices = {}
    for (kernel, shape), example in sorted(kernel_calls(engine).items(), key=lambda item: str(item[0])):
        if cache.get(kernel, device_kind, shape) is None and time.perf_counter() > deadline:
            continue
        choices[(kernel, shape)] = tuning.tune(kernel, shape, RUNS[kernel](shape, example, interpret), cache=cache,
                                               device_kind=device_kind, timer=timer)
    # The recording's traces (and anything compiled before) hold the defaults: the programs
    # trace and compile again with the choices (whose digest is part of a stored program's key).
    jax.clear_caches()
    engine.compiled.forget()
    return choices
