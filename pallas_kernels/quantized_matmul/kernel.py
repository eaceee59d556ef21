"""The quantized matmul's entry point: its block sizes, the shapes it takes, and the choice
between the Triton kernel, its interpreted body (CPU) and the reference (other backends)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import triton_kernel
from pallas_kernels.quantized_matmul.reference import reference

MAX_ROWS = 64  # decode-sized products; more rows are compute-bound and XLA's dot is the tool
TARGET_PROGRAMS = 512  # about four per SM of an H100/H200 (132): enough loads in flight
EIGHT_BIT = (jnp.int8, jnp.float8_e4m3fn)


def _largest_power_of_two_dividing(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def block_sizes(out_dim: int, in_dim: int, groups: int) -> tuple[int, int, int]:
    """`(block_n, block_k, splits)` for a `[out_dim, in_dim]` weight with `groups` scales a row:
    a group (or 256 inputs, per-row scales) a step, 64 outputs a program, and the inputs split
    until there are about TARGET_PROGRAMS programs, each with at least 4 steps."""
    block_k = in_dim // groups if groups > 1 else _largest_power_of_two_dividing(in_dim, 256)
    block_n = _largest_power_of_two_dividing(out_dim, 64)
    steps, splits = in_dim // block_k, 1
    while (out_dim // block_n) * splits < TARGET_PROGRAMS and steps % (splits * 2) == 0 \
            and steps // (splits * 2) >= 4:
        splits *= 2
    return block_n, block_k, splits


def unsupported(rows: int, out_dim: int, in_dim: int, groups: int, dtype) -> str | None:
    """Why the kernel does not take this product (the caller then uses XLA's dot), or None."""
    group = in_dim // max(groups, 1)
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in EIGHT_BIT]:
        return f"the weight is {jnp.dtype(dtype)}, the kernel reads int8 or float8_e4m3fn"
    if rows > MAX_ROWS:
        return f"{rows} rows: the kernel is for decode-sized products (<= {MAX_ROWS} rows)"
    if groups > 1 and (group < 16 or group & (group - 1) or in_dim % groups):
        return f"groups of {group} inputs: the kernel takes power-of-two groups >= 16"
    block_n, block_k, _ = block_sizes(out_dim, in_dim, groups)
    if block_n < 16 or block_k < 16:
        return f"a [{out_dim}, {in_dim}] weight has no power-of-two blocks >= 16"
    return None


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "splits", "num_warps", "num_stages"))
def quantized_matmul(x, values, scale, *, interpret: bool = False, block_n: int | None = None,
                     splits: int | None = None, num_warps: int = 4, num_stages: int = 4):
    """`x [..., in] @ (values * scale).T` in x's dtype (f32 accumulation): `values [out, in]`
    int8 or float8_e4m3fn, `scale [out, groups]` float32 (see `reference`). On a GPU the Triton
    kernel; `interpret=True` runs its body in Pallas interpret mode (any platform); otherwise a
    CPU or TPU computes the reference. `block_n`, `splits`, `num_warps`, `num_stages`: launch
    settings (default: `block_sizes`), for tuning."""
    lead, in_dim = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, in_dim)
    out_dim, groups = scale.shape
    why_not = unsupported(flat.shape[0], out_dim, in_dim, groups, values.dtype)
    if why_not:
        raise ValueError(f"quantized_matmul: {why_not}")
    auto_n, block_k, auto_splits = block_sizes(out_dim, in_dim, groups)
    block_n, splits = block_n or auto_n, splits or auto_splits
    if out_dim % block_n or (in_dim // block_k) % splits:
        raise ValueError(f"quantized_matmul: block_n={block_n} must divide {out_dim} outputs and splits={splits} "
                         f"the {in_dim // block_k} input steps of {block_k}")
    launch = functools.partial(triton_kernel.matmul, block_n=block_n, splits=splits,
                               block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    if interpret:
        y = launch(flat, values, scale, interpret=True)
    else:
        y = jax.lax.platform_dependent(flat, values, scale, cuda=functools.partial(launch, interpret=False),
                                       default=reference)
    return y.astype(x.dtype).reshape(lead + (out_dim,))
