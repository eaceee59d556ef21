"""The CPU's roofline with both sides, measured in the run that reports against it.

A decode step of `rows` sequences cannot be faster than the larger of

- memory: the bytes it must read (the weights as the engine holds them, plus the keys and
  values of every row's context) over the best read bandwidth measured here. Several read
  methods each count the bytes they read: the C++ read loop (cbjax/runtime/cpu/bandwidth.h)
  over a buffer larger than the caches with every thread the engine's kernels use, the
  same loop on one thread, numpy's sum, and XLA's and the CPU kernel's matvec over a
  matrix the size of the buffer. The best is the roof (`GBps`), each figure is kept.
- compute: the step's matmuls at its shapes (`rows` x each weight matrix, the LM head
  included) through the best GEMM the machine offers for them, in f32: XLA's, timed on a
  block of the matrix's shape that stays in the caches (`CACHED_BYTES`) and scaled to the
  whole, or the CPU kernels' own (up to their 64 rows), every kernel thread multiplying its
  own block in its L2 over and over in C++ (cbjax/runtime/cpu/bandwidth.h): the arithmetic
  alone. That is the arithmetic the kernels do for every format: int8 and the GGUF blocks
  are widened to f32 in registers and multiplied in f32 (`COMPUTE_ARITHMETIC`); the
  widening's own work is not in the roof, so a quantized step at large batch sits further
  below it than an f32 one.

The matvec over a weights-sized matrix alone, the old reference, read 28-34 GB/s from run to
run on the 2-core VM (an f32 step then printed 114% and 145% of it). A share of this roof
above 100% means the instrument is wrong, and `share_text` says so (`common.suspect`).
"""

from __future__ import annotations

import os
import time

import numpy as np

from experiments.lib.common import suspect

READ_BYTES = 1 << 30  # 32x the 2-core VM's L3: no pass is served from the caches
COMPUTE_ARITHMETIC = {"f32": "f32 FMA", "int8": "int8 widened to f32, f32 FMA",
                      "gguf": "GGUF blocks widened to f32, f32 FMA"}


def define_read_flag() -> None:
    """`--roofline_read_mb`, for the scripts that report against this roofline."""
    from absl import flags

    flags.DEFINE_integer("roofline_read_mb", READ_BYTES >> 20, "The CPU roofline's read buffer in MB (larger than "
                         "the caches; experiments/lib/cpu_roofline.py).", lower_bound=1)


def kernel_threads() -> int:
    """The threads the CPU kernels use: `$CBJAX_CPU_KERNEL_THREADS`, else the CPUs this process may run on."""
    if os.environ.get("CBJAX_CPU_KERNEL_THREADS"):
        return max(1, int(os.environ["CBJAX_CPU_KERNEL_THREADS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fastest(calls: dict, repeats: int) -> dict[str, float]:
    """Each call's fastest of `repeats` timed runs (after one untimed), the runs taken in turn
    (one of each, `repeats` times): a slow stretch of a shared machine touches every call
    alike instead of all of one call's runs."""
    for fn in calls.values():
        fn()
    best = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def memory_side(read_bytes: int = READ_BYTES, repeats: int = 12, threads: int | None = None) -> dict:
    """Every read method's GB/s over `read_bytes` (each the fastest of `repeats` passes, the
    methods in turn), the best (`GBps`) and its method."""
    import jax
    import jax.numpy as jnp

    from cbjax.experimental import kernels as cpu_kernels

    threads = threads or kernel_threads()
    buffer = np.random.default_rng(0).standard_normal(read_bytes // 4, dtype=np.float32)
    matrix = jnp.asarray(buffer.reshape(-1, 512))
    x = jnp.ones((1, 512), jnp.float32)
    xla = jax.jit(lambda x, m: jnp.einsum("bd,vd->bv", x, m))
    calls = {"numpy_sum": lambda: buffer.sum(), "xla_matvec": lambda: xla(x, matrix).block_until_ready()}
    if cpu_kernels.available():
        kernel = jax.jit(cpu_kernels.matmul_nt)
        calls[f"cpp_read_{threads}_threads"] = lambda: cpu_kernels.read_sum(buffer, threads)
        if threads > 1:
            calls["cpp_read_1_thread"] = lambda: cpu_kernels.read_sum(buffer, 1)
        calls["kernel_matvec"] = lambda: kernel(x, matrix).block_until_ready()
    methods = {name: read_bytes / seconds for name, seconds in fastest(calls, repeats).items()}
    best = max(methods, key=methods.get)
    return {"GBps": methods[best] / 1e9, "method": best, "threads": threads, "bytes": read_bytes,
            "methods_GBps": {k: v / 1e9 for k, v in methods.items()}}


def kv_bytes_per_token(config, kv_cache_dtype: str, model_dtype) -> int:
    """The bytes of one token's keys and values over all layers, as the cache stores them."""
    from cbjax.experimental import kv_bytes_per_token as per_token, kv_storage_dtype

    return per_token(config, kv_storage_dtype(kv_cache_dtype, model_dtype).itemsize)


def matmul_shapes(config) -> dict[tuple[int, int], int]:
    """A dense decoder step's matmuls, `(out, in)` -> how many a step runs (the LM head's once)."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    per_layer = [(config.num_heads * hd, d), (config.num_kv_heads * hd, d), (config.num_kv_heads * hd, d),
                 (d, config.num_heads * hd), (inter, d), (inter, d), (d, inter)]
    shapes: dict[tuple[int, int], int] = {}
    for shape in per_layer:
        shapes[shape] = shapes.get(shape, 0) + config.num_layers
    head = (config.vocab_size, d)
    shapes[head] = shapes.get(head, 0) + 1
    return shapes


CACHED_BYTES = 8 << 20  # a weight block the compute side times: in this VM's 32 MB L3, so the GEMM is not waiting on memory


def xla_gemm(rows: int, out: int, inner: int) -> tuple:
    """XLA's `x [rows, inner] @ w.T` for a block of CACHED_BYTES of `w [out, inner]`'s shape
    that stays in the caches (the LM head is 113 MB: timed whole it measures memory, not
    arithmetic; a small matrix timed whole is mostly the call's dispatch), in f32; and the
    factor from the block's time to the whole matrix's."""
    import jax
    import jax.numpy as jnp

    block = max(1, CACHED_BYTES // (4 * inner))
    rng = np.random.default_rng(rows * 7 + out)
    x, w = (jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in ((rows, inner), (block, inner)))
    xla = jax.jit(lambda x, w: jnp.einsum("bd,vd->bv", x, w))
    return (lambda: xla(x, w).block_until_ready()), out / block


def kernel_gflops(rows: int, inner: int, trials: int = 3) -> float | None:
    """The CPU kernels' f32 matmul at `rows` x `inner` on every kernel thread, each over its own
    block held in its L2 (bandwidth.h), the best of `trials`; None without the kernels or past
    their rows."""
    from cbjax.experimental import kernels as cpu_kernels

    if not cpu_kernels.available() or rows > cpu_kernels.MAX_ROWS:
        return None
    return max(cpu_kernels.matmul_gflops(rows, inner, kernel_threads()) for _ in range(trials))


ARITHMETIC_ROWS = 8


def compute_side(config, batches, repeats: int = 12) -> dict:
    """Per batch: the step's matmuls (`matmul_shapes`) at the best GEMM for each shape, XLA's
    (cached blocks, one call each) or the CPU kernels' (each thread its block in its L2, many
    calls in C++: no dispatch), their seconds summed, the GFLOP they do and the rate that makes;
    each GEMM's figures by method. Not numpy's: OpenBLAS's threads spin for a while after each
    call, and timed in turn with the others they took the cores from them (the kernel's 8-row
    GEMM measured 41 GFLOP/s there against 148 alone). Below ARITHMETIC_ROWS rows the GEMMs
    are timed at ARITHMETIC_ROWS and their time scaled down: a block at one row streams from
    the caches faster than it multiplies (the L3's bandwidth, not arithmetic: 24 GFLOP/s, a
    "compute" floor above the memory one), and a GEMM's rate does not rise as its rows fall."""
    shapes = matmul_shapes(config)
    out = {}
    for rows in batches:
        timed_rows = max(rows, ARITHMETIC_ROWS)
        calls, scale = {}, {}
        for (n, k) in shapes:
            calls[(n, k)], scale[(n, k)] = xla_gemm(timed_rows, n, k)
        timed = fastest(calls, repeats)
        kernel = {k: kernel_gflops(timed_rows, k) for k in {k for _, k in shapes}}
        seconds, flops, by_shape = 0.0, 0.0, {}
        for (n, k), count in shapes.items():
            shape_flops = 2.0 * rows * n * k
            mine = {"xla": timed[(n, k)] * scale[(n, k)] * rows / timed_rows}
            if kernel[k]:
                mine["kernel"] = shape_flops / (kernel[k] * 1e9)
            best = min(mine, key=mine.get)
            seconds += count * mine[best]
            flops += count * shape_flops
            by_shape[f"{n}x{k}"] = {"count": count, "method": best,
                                    **{f"{m}_GFLOPs": shape_flops / s / 1e9 for m, s in mine.items()}}
        out[rows] = {"ms": 1e3 * seconds, "GFLOP": flops / 1e9, "GFLOPs": flops / seconds / 1e9,
                     "timed_at_rows": timed_rows, "shapes": by_shape}
    return out


class CpuRoofline:
    """Both sides for one model at the batches a benchmark reports: `floor_ms(rows, kv_bytes)`
    is the larger of the memory and the compute time of a step; `share(ms, ...)` what a
    measured step makes of it."""

    def __init__(self, config, weight_bytes: int, batches, arithmetic: str = "f32", read_bytes: int = READ_BYTES,
                 memory: dict | None = None, compute: dict | None = None):
        """Measures both sides, or takes `memory_side`'s and `compute_side`'s figures measured
        already (one run's weight formats share them)."""
        self.weight_bytes = weight_bytes
        self.arithmetic = COMPUTE_ARITHMETIC[arithmetic]
        self.memory = memory or memory_side(read_bytes)
        self.compute = compute or compute_side(config, sorted(set(batches)))

    def floor_ms(self, rows: int, kv_bytes: float = 0.0) -> dict:
        memory_ms = 1e3 * (self.weight_bytes + kv_bytes) / (self.memory["GBps"] * 1e9)
        compute_ms = self.compute[rows]["ms"]
        return {"ms": max(memory_ms, compute_ms), "memory_ms": memory_ms, "compute_ms": compute_ms,
                "bound": "memory" if memory_ms >= compute_ms else "compute"}

    def share(self, ms: float, rows: int, kv_bytes: float = 0.0) -> float:
        return self.floor_ms(rows, kv_bytes)["ms"] / ms

    def describe(self) -> str:
        m = self.memory
        rates = ", ".join(f"{rows} rows {c['GFLOPs']:.0f} GFLOP/s ({c['ms']:.1f} ms)" for rows, c in self.compute.items())
        return (f"roofline: memory {m['GBps']:.1f} GB/s ({m['method']}; "
                + ", ".join(f"{k} {v:.1f}" for k, v in m["methods_GBps"].items())
                + f"), compute ({self.arithmetic}, the step's GEMMs) {rates}")

    def to_json(self) -> dict:
        return {"memory": self.memory, "compute": {str(k): v for k, v in self.compute.items()},
                "arithmetic": self.arithmetic, "weight_bytes": self.weight_bytes}


def share_text(share: float) -> str:
    """A share of the roofline for a table cell, flagged past 100%."""
    return suspect(share).replace(" of roofline", "")
