"""What both Mosaic GPU kernels (decode_matmul/mosaic_kernel.py, ragged_paged_attention/
mosaic_kernel.py) set up alike: a wgmma operand's shared-memory layout, and what `interpret=True`
means for them. Pallas' Mosaic GPU module is imported inside each helper: its MLIR dialects are
slow to import, which every process importing cbjax would pay (docs/code_measurements.md)."""

from __future__ import annotations

import jax.numpy as jnp


def swizzled(dtype, inner: int, role: str) -> tuple:
    """A shared-memory tile's tiling and swizzle for rows of `inner` elements of `dtype` (`role`,
    "lhs", "rhs" or "out", names it in Mosaic GPU's error if none fits)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(inner * bits, role)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def interpret_params():
    """Pallas' GPU interpreter (threads, shared memory, TMA and barriers simulated on the CPU)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
