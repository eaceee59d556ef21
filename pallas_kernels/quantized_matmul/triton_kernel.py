"""`x @ w.T` for 8-bit weights with a float32 scale per group of a row, as a Pallas kernel for
the Triton lowering (GPU; interpret mode on CPU): the decode-sized product, a few rows of
activations against a whole weight matrix, which is a stream over the weight's bytes.

Grid `(out / block_n, splits)`: program (i, s) owns output columns `[i * block_n, ...)` and
the s-th of `splits` equal spans of the inputs, and walks its span one group (`block_k`
inputs) at a time: the 8-bit tile `[block_n, block_k]` is widened to the activations' dtype
(exact for int8 and e4m3), multiplied on the tensor cores with f32 accumulation, and the
group's partial sums are scaled by the group's scale (`[block_n]`) before they are added.
So the scales multiply `rows x block_n` partial sums, never the weight tile, and the weight
is read once, 8 bits an element. Splitting the inputs gives a matrix with few output blocks
(4096 outputs: 64-128 blocks) enough programs to keep every SM's loads in flight; the splits'
f32 partial outputs are summed outside (`rows x out x splits` floats, small beside the weight).
Each product is computed transposed, `w_tile @ x_tile.T`, so the scales broadcast as loaded.

Triton's dots want every dimension >= 16: the activations are padded to 16 rows (or the next
power of two) with zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16  # Triton's dot wants every dimension >= 16


def padded_rows(rows: int) -> int:
    return max(pl.next_power_of_2(rows), MIN_ROWS)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_k: int, steps: int, per_row: bool):
    # Outputs are computed transposed, `[block_n, rows]`, so that a group's scales `[block_n, 1]`
    # (a column of the scale block) broadcast over them as loaded.
    span = pl.program_id(1) * steps  # first group of this program's inputs

    def body(i, acc):
        k = (span + i) * block_k
        x = x_ref[:, pl.ds(k, block_k)]  # [rows, block_k]
        w = w_ref[:, pl.ds(k, block_k)].astype(x.dtype)  # [block_n, block_k]
        part = jnp.dot(w, x.T, preferred_element_type=jnp.float32)  # [block_n, rows]
        return acc + part if per_row else acc + part * s_ref[:, pl.ds(span + i, 1)]

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc * s_ref[:, pl.ds(0, 1)] if per_row else acc


def matmul(x, values, scale, *, block_n: int, splits: int, block_k: int, num_warps: int, num_stages: int,
           interpret: bool):
    """`x [rows, in] @ (values * scale).T` as f32 `[rows, out]`: `values [out, in]` 8-bit,
    `scale [out, groups]` f32 (groups of `in / groups` inputs; one group: a scale per row).
    `block_n` must divide `out`; `block_k` (a power of two >= 16) must divide the group size,
    or with one group per row, `in`; `splits` must divide `in / block_k`."""
    rows, in_dim = x.shape
    out_dim, groups = scale.shape
    per_row = groups == 1
    group = in_dim // groups
    if not per_row and block_k != group:
        raise ValueError(f"block_k must be the group size ({group}) for grouped scales, got {block_k}")
    steps = in_dim // block_k // splits
    padded = padded_rows(rows)
    xp = jnp.pad(x, ((0, padded - rows), (0, 0)))
    kernel = functools.partial(_kernel, block_k=block_k, steps=steps, per_row=per_row)
    partial_sums = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, out_dim, padded), jnp.float32),
        grid=(out_dim // block_n, splits),
        in_specs=[
            pl.BlockSpec((padded, in_dim), lambda i, s: (0, 0)),
            pl.BlockSpec((block_n, in_dim), lambda i, s: (i, 0)),
            pl.BlockSpec((block_n, groups), lambda i, s: (i, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_n, padded), lambda i, s: (s, i, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="cbjax_quantized_matmul",
    )(xp, values, scale)
    return partial_sums.sum(axis=0)[:, :rows].T
