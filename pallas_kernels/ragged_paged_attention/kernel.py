"""Entry point of the ragged paged-attention kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import triton_kernel


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, scale: float,
                           block_q: int = 16, pages_per_block: int = 4, interpret: bool = False):
    """Attention of a flat batch of query tokens `q [T, q_heads, hd]` over paged K/V
    (`[kv_heads, num_pages, page_size, hd]`): sequence s owns rows
    `[cu_q_lens[s], cu_q_lens[s + 1])` and its first `kv_lens[s]` keys on pages
    `page_indices[s]`; causal within its new tokens. Returns `[T, q_heads, hd]` in q's
    dtype; rows past `cu_q_lens[-1]` are left unspecified."""
    if q.shape[1] % k_pages.shape[0]:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k_pages.shape[0]})")
    if cu_q_lens.shape[0] != kv_lens.shape[0] + 1 or page_indices.shape[0] != kv_lens.shape[0]:
        raise ValueError("cu_q_lens must have one entry more than kv_lens and page_indices have rows")
    out = triton_kernel.attention(q, k_pages, v_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
                                  cu_q_lens.astype(jnp.int32), scale=scale, block_q=block_q,
                                  pages_per_block=min(pages_per_block, page_indices.shape[1]), interpret=interpret)
    return out.astype(q.dtype)
