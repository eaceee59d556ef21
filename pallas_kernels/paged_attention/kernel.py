"""Entry point of the paged decode-attention kernel: run the per-split partials, then combine."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import triton_kernel


def combine(o, m, l, q_shape, dtype):
    """Merge per-split partials with a numerically safe log-sum-exp; empty sequences give 0."""
    m_max = jnp.max(m, axis=2, keepdims=True)  # [slots, kv_heads, 1, block_g]
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    weight = jnp.exp(m - m_max)  # an empty split has m = -inf and weight 0
    num = jnp.sum(o * weight[..., None], axis=2)
    den = jnp.sum(l * weight, axis=2)
    out = num / jnp.where(den > 0, den, 1.0)[..., None]  # [slots, kv_heads, block_g, hd]
    slots, q_heads, head_dim = q_shape
    kv_heads = o.shape[1]
    group = q_heads // kv_heads
    return out[:, :, :group].reshape(slots, q_heads, head_dim).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "splits", "interpret", "backend"))
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale: float, pages_per_block: int = 4,
                    splits: int = 4, interpret: bool = False, backend: str = "triton"):
    """Decode attention of `q [slots, q_heads, hd]` over paged K/V
    (`[kv_heads, num_pages, page_size, hd]`), `block_tables [slots, pages_per_seq]`,
    `lengths [slots]`; returns `[slots, q_heads, hd]` in q's dtype. `backend`: "triton"
    (our kernel; GPU, or interpret mode) or "tpu" (JAX's TPU kernel, see `tpu.py`)."""
    if q.shape[1] % k_pages.shape[0]:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k_pages.shape[0]})")
    if backend == "tpu":
        from pallas_kernels.paged_attention.tpu import tpu_paged_attention

        return tpu_paged_attention(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                                   pages_per_block=min(pages_per_block, block_tables.shape[1]))
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'tpu', got {backend!r}")
    o, m, l = triton_kernel.partials(q, k_pages, v_pages, block_tables, lengths.astype(jnp.int32), scale=scale,
                                     pages_per_block=pages_per_block, splits=splits, interpret=interpret)
    return combine(o, m, l, q.shape, q.dtype)
