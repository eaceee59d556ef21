"""`x @ w.T` for 8-bit weights with a float32 scale per group of a row (or float weights with
none), as a Pallas kernel for the Triton lowering (GPU; interpret mode on CPU): the
decode-sized product, a few rows of activations against a whole weight matrix, which is a
stream over the weight's bytes.

Grid `(out / block_n, splits)`: program (i, s) owns output columns `[i * block_n, ...)` and
the s-th of `splits` equal spans of the inputs, and walks its span `block_k` inputs (a group,
or with one scale a row, up to 256) at a time, `unroll` such blocks a loop step (independent
loads in flight). The 8-bit tile `[block_n, block_k]` is widened (exact for int8 and e4m3)
and the group's partial sums are scaled by its scale (`[block_n, 1]`) before they are added,
so the scales multiply partial sums, not the weight tile ("stream" excepted), and the weight
is read once, 8 bits an element. Splitting the inputs gives a matrix with few output blocks (4096 outputs:
64-128 blocks) enough programs to keep every SM's loads in flight; the splits' f32 partial
outputs are summed outside (`out x rows x splits` floats, small beside the weight).

Two ways to multiply a tile (`form`):
- "dot": `w_tile @ x_tile.T` on the tensor cores (f32 accumulation), the activations padded to
  16 rows (Triton's dots want every dimension >= 16);
- "reduce": per activation row, the widened tile times the row, summed along the inputs on the
  CUDA cores: no padding, no tensor-core layout shuffles; its work grows with the rows, so it
  is for one to a few rows;
- "stream": as "reduce", but each row's products (the tile scaled first) are added into a
  `[block_n, block_k]` f32 accumulator and summed along the inputs once, after the loop (no
  cross-lane sums a step).
Outputs are computed transposed, `[block_n, rows]`, so the scales broadcast as loaded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Pallas' Triton module is imported where a kernel is built, not here: its MLIR dialect
# is slow to import, which every process importing cbjax paid (a server's start, a script's --help).

MIN_ROWS = 16  # Triton's dot wants every dimension >= 16
FORMS = ("dot", "reduce", "stream")


def padded_rows(rows: int, form: str) -> int:
    return max(pl.next_power_of_2(rows), MIN_ROWS) if form == "dot" else rows


def _kernel(x_ref, w_ref, *refs, block_k: int, steps: int, unroll: int, per_row: bool, form: str):
    *s_ref, o_ref = refs  # no scales: a float weight
    s_ref = s_ref[0] if s_ref else None
    first = pl.program_id(1) * steps * unroll  # this program's first block of inputs
    rows = x_ref.shape[0]
    block_n = w_ref.shape[0]

    def scaled(part, block):
        return part if per_row or s_ref is None else part * s_ref[:, pl.ds(block, 1)]  # the group's scale

    def product(block):
        k = block * block_k
        w = w_ref[:, pl.ds(k, block_k)]  # [block_n, block_k], 8-bit
        if form == "dot":
            x = x_ref[:, pl.ds(k, block_k)]  # [rows, block_k]
            return scaled(jnp.dot(w.astype(x.dtype), x.T, preferred_element_type=jnp.float32), block)
        w = w.astype(jnp.float32)
        if form == "stream":  # the tile scaled: its products are summed across groups after the loop
            w = scaled(w, block)
            return [w * x_ref[r, pl.ds(k, block_k)].astype(jnp.float32)[None, :] for r in range(rows)]
        sums = [jnp.sum(w * x_ref[r, pl.ds(k, block_k)].astype(jnp.float32)[None, :], axis=1) for r in range(rows)]
        return scaled(_columns(sums), block)

    def body(i, acc):
        for u in range(unroll):
            part = product(first + i * unroll + u)
            acc = [a + p for a, p in zip(acc, part)] if form == "stream" else acc + part
        return acc

    if form == "stream":
        init = [jnp.zeros((block_n, block_k), jnp.float32) for _ in range(rows)]
        acc = _columns([jnp.sum(a, axis=1) for a in jax.lax.fori_loop(0, steps, body, init)])
    else:
        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc * s_ref[:, pl.ds(0, 1)] if per_row and s_ref is not None else acc


def _columns(vectors: list) -> jax.Array:
    """`[n]` vectors as the columns of `[n, len(vectors)]`."""
    columns = [v[:, None] for v in vectors]
    return columns[0] if len(columns) == 1 else jnp.concatenate(columns, axis=1)


def matmul(x, values, scale, *, form: str, block_n: int, splits: int, block_k: int, unroll: int, num_warps: int,
           num_stages: int, interpret: bool):
    """`x [rows, in] @ (values * scale).T` as f32 `[rows, out]`: `values [out, in]` 8-bit,
    `scale [out, groups]` f32 (groups of `in / groups` inputs; one group: a scale per row), or
    `values` float and `scale` None.
    `block_n` must divide `out`; `block_k` (a power of two >= 16) must be the group size, or
    with one group per row divide `in`; `splits * unroll` must divide `in / block_k`."""
    from jax.experimental.pallas import triton as plgpu

    rows, in_dim = x.shape
    out_dim, groups = values.shape[0], (1 if scale is None else scale.shape[1])
    per_row = groups == 1
    if not per_row and block_k != in_dim // groups:
        raise ValueError(f"block_k must be the group size ({in_dim // groups}) for grouped scales, got {block_k}")
    steps = in_dim // block_k // splits // unroll
    padded = padded_rows(rows, form)
    xp = jnp.pad(x, ((0, padded - rows), (0, 0))) if padded > rows else x
    kernel = functools.partial(_kernel, block_k=block_k, steps=steps, unroll=unroll, per_row=per_row, form=form)
    partial_sums = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, out_dim, padded), jnp.float32),
        grid=(out_dim // block_n, splits),
        in_specs=[
            pl.BlockSpec((padded, in_dim), lambda i, s: (0, 0)),
            pl.BlockSpec((block_n, in_dim), lambda i, s: (i, 0)),
            *([pl.BlockSpec((block_n, groups), lambda i, s: (i, 0))] if scale is not None else []),
        ],
        out_specs=pl.BlockSpec((None, block_n, padded), lambda i, s: (s, i, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="cbjax_decode_matmul",
    )(xp, values, *([scale] if scale is not None else []))
    return partial_sums.sum(axis=0)[:, :rows].T
