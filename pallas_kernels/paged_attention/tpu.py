"""TPU backend: JAX's own Pallas TPU paged-attention kernel, adapted to our calling convention.

It takes a pre-scaled q, casts K/V to bfloat16 inside, and needs valid page ids
everywhere; a slot of length 0 gets zeros, as from our kernel and the reference.
Tested on CPU under `pltpu.force_tpu_interpret_mode()` with megacore off (megacore
hangs there).
"""

from __future__ import annotations

import jax.numpy as jnp


def tpu_paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale: float, pages_per_block: int):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    num_pages = k_pages.shape[1]
    out = paged_attention((q * scale).astype(q.dtype), k_pages, v_pages, lengths.astype(jnp.int32),
                          jnp.clip(block_tables, 0, num_pages - 1).astype(jnp.int32),
                          pages_per_compute_block=pages_per_block, megacore_mode=None)
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)
