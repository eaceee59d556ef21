"""The pure-JAX reference for the decode matmul kernel: the same product, written plainly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


# One program per shape, not one per op (see the attention reference).
@jax.jit
def reference(x, values, scale=None):
    """`x [rows, in] @ (values * scale).T` in f32: `values [out, in]` 8-bit, `scale [out, groups]`
    float32, group g of row i being `values[i, g * size:(g + 1) * size] * scale[i, g]`. Each
    group's partial sums are taken over the widened values and then scaled, as the kernel does.
    A float weight has no scale (None): `x @ values.T` in f32."""
    if scale is None:
        return jnp.einsum("rk,ok->ro", x.astype(jnp.float32), values.astype(jnp.float32))
    out_dim, groups = scale.shape
    rows, in_dim = x.shape
    xg = x.astype(jnp.float32).reshape(rows, groups, in_dim // groups)
    vg = values.astype(jnp.float32).reshape(out_dim, groups, in_dim // groups)
    partial_sums = jnp.einsum("rgk,ogk->rog", xg, vg)
    return jnp.einsum("rog,og->ro", partial_sums, scale)
