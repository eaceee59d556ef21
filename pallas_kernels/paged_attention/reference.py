"""Pure-JAX paged decode attention: the reference every kernel is checked against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference(
    q: jax.Array,  # [slots, q_heads, head_dim]
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [slots, pages_per_seq] int32
    lengths: jax.Array,  # [slots] int32
    scale: float,
) -> jax.Array:
    """One query per slot over the first `lengths[s]` tokens of its pages, in float32.
    A slot of length 0 attends to nothing and gets zeros."""
    slots, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    pages = jnp.clip(block_tables, 0, num_pages - 1)
    # [kv_heads, slots, pages_per_seq, page_size, hd] -> [slots, kv_heads, tokens, hd]
    k = k_pages[:, pages].reshape(kv_heads, slots, -1, head_dim).swapaxes(0, 1).astype(jnp.float32)
    v = v_pages[:, pages].reshape(kv_heads, slots, -1, head_dim).swapaxes(0, 1).astype(jnp.float32)
    qg = q.reshape(slots, kv_heads, group, head_dim).astype(jnp.float32)
    logits = jnp.einsum("skgd,sktd->skgt", qg, k) * scale
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [slots, tokens]
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(valid[:, None, None, :], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(-1, keepdims=True)
    out = jnp.einsum("skgt,sktd->skgd", p, v) / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(slots, q_heads, head_dim).astype(q.dtype)
