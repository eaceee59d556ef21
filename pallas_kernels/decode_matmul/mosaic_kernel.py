"""`x @ w.T` for decode-sized products on Mosaic GPU, Pallas' Hopper backend (TMA copies into a
pipeline of shared-memory stages, wgmma on the tensor cores): the backend JAX keeps, where the
Triton one (triton_kernel.py) is deprecated.

Grid `(out / block_n, splits)`: program (i, s) owns outputs `[i * block_n, ...)` and the s-th
of `splits` equal spans of the inputs; `emit_pipeline` streams its weight tiles `[block_n,
block_k]` and the activations' tiles through `stages` buffers, and each step is one wgmma,
`w_tile [block_n, block_k] @ xt_tile [block_k, 64]` into an f32 accumulator: the weight is
wgmma's A side (its M is a multiple of 64 outputs), the activations, transposed and padded to
64 rows, its B side (a decode step's rows are few; the padding costs shared memory, not HBM).
An 8-bit weight tile is widened into a shared-memory tile of x's dtype first (exact: every int8
and e4m3 value is a bf16; e4m3 through f32, which the hardware converts), because Pallas'
GPU interpreter's wgmma reads A from shared memory only, and what the interpreter checks is
what runs. The splits' f32 partial outputs are summed, and a per-output scale applied once
each, outside, in XLA.

Not here, on purpose (the Triton kernel keeps them): grouped scales (a group's scale column
broadcast across the accumulator or the tile fails Mosaic GPU's layout inference at JAX 0.10,
and its interpreter has no `layout_cast` to guide it), f32 activations, and an 8-bit A side
fed from registers (faster on the device, but not what the interpreter can run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu import interpret_params, swizzled

# Pallas' Mosaic GPU module is imported where a kernel is built, not here: its MLIR dialects
# are slow to import, which every process importing cbjax paid (a server's start, a script's --help).
TILE_ROWS = 64  # wgmma's B side: the activations' rows, padded
ACTIVATIONS = (jnp.bfloat16, jnp.float16)
WEIGHTS = (jnp.bfloat16, jnp.float16, jnp.int8, jnp.float8_e4m3fn)


def unsupported(rows: int, out_dim: int, in_dim: int, groups: int, dtype, x_dtype, *, block_n: int,
                block_k: int, splits: int) -> str | None:
    """Why this kernel does not take the product at these settings (the tuner then leaves it
    out), or None."""
    if jnp.dtype(x_dtype) not in [jnp.dtype(d) for d in ACTIVATIONS]:
        return f"Mosaic GPU form: activations are {jnp.dtype(x_dtype).name}, it takes bf16 or f16"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in WEIGHTS]:
        return f"Mosaic GPU form: the weight is {jnp.dtype(dtype).name}"
    if jnp.dtype(dtype).itemsize == 2 and jnp.dtype(dtype) != jnp.dtype(x_dtype):
        return "Mosaic GPU form: a 16-bit weight must have the activations' dtype"
    if groups > 1:
        return "Mosaic GPU form: grouped scales stay with the Triton forms"
    if rows > TILE_ROWS:
        return f"Mosaic GPU form: {rows} rows > {TILE_ROWS}"
    if block_n % 64 or out_dim % block_n or in_dim % (block_k * splits) or block_k * 2 < 128:
        return (f"Mosaic GPU form: a [{out_dim}, {in_dim}] weight in blocks of {block_n} x {block_k} "
                f"over {splits} splits (block_n a multiple of 64 dividing out, block_k x splits dividing in)")
    return None


def matmul(x, values, *, block_n: int, block_k: int, splits: int, stages: int, interpret: bool):
    """`x [rows, in] @ values.T` as f32 `[rows, out]` (8-bit values unscaled: the caller scales)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows, in_dim = x.shape
    out_dim = values.shape[0]
    steps = in_dim // block_k // splits
    xt = jnp.pad(x, ((0, TILE_ROWS - rows), (0, 0))).T  # [in, 64]: wgmma's B side
    widen = values.dtype != x.dtype

    def body(w_gmem, x_gmem, o_gmem, o_smem, a_smem):
        n, s = lax.axis_index("n"), lax.axis_index("s")

        def accumulate(acc_ref):
            def step(_, w_smem, x_smem):
                a = w_smem
                if widen:
                    w = w_smem[...]
                    a_smem[...] = (w.astype(jnp.float32) if w.dtype == jnp.float8_e4m3fn else w).astype(x.dtype)
                    plgpu.commit_smem()
                    a = a_smem
                plgpu.wgmma(acc_ref, a, x_smem)
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step, grid=(steps,), max_concurrent_steps=stages,
                in_specs=[plgpu.BlockSpec((block_n, block_k), lambda k: (n, s * steps + k),
                                          transforms=swizzled(values.dtype, block_k, "lhs")),
                          plgpu.BlockSpec((block_k, TILE_ROWS), lambda k: (s * steps + k, 0),
                                          transforms=swizzled(x.dtype, TILE_ROWS, "rhs"))])(w_gmem, x_gmem)
            o_smem[...] = acc_ref[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, pl.ds(n * block_n, block_n)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulate, plgpu.ACC((block_n, TILE_ROWS), jnp.float32))

    partial_sums = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, out_dim, TILE_ROWS), jnp.float32),
        grid=(out_dim // block_n, splits),
        grid_names=("n", "s"),
        scratch_types=dict(
            o_smem=plgpu.SMEM((block_n, TILE_ROWS), jnp.float32, transforms=swizzled(jnp.float32, TILE_ROWS, "out")),
            a_smem=plgpu.SMEM((block_n, block_k), x.dtype, transforms=swizzled(x.dtype, block_k, "lhs"))),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params() if interpret else None,
    )(values, xt)
    return partial_sums.sum(axis=0)[:, :rows].T

