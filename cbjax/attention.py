"""Attention over a slot-cache row: the pure-JAX reference path that runs everywhere.

Queries of a chunk attend to the keys already in their slot plus the chunk's own
(written into the cache before this is called), so one function serves a fresh
prefill, a chunked prefill and a decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(q_positions: jax.Array, kv_len: int, window: jax.Array | int = 0) -> jax.Array:
    """Causal (optionally sliding-window) mask, `[B, T, kv_len]`; True where a key is visible.

    Key j sits at absolute position j of its slot. `window` 0 means full attention;
    otherwise a query at position p sees keys in (p - window, p], as in transformers.
    """
    k_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
    q_pos = q_positions[:, :, None]
    visible = k_pos <= q_pos
    in_window = (window == 0) | (k_pos > q_pos - window)
    return visible & in_window


def reference_attention(
    q: jax.Array,  # [B, T, q_heads, head_dim]
    k: jax.Array,  # [B, kv_heads, K, head_dim]
    v: jax.Array,  # [B, kv_heads, K, head_dim]
    mask: jax.Array,  # [B, T, K] bool
    scale: float,
) -> jax.Array:
    """Grouped-query attention with float32 softmax; returns `[B, T, q_heads, head_dim]`."""
    b, t, hq, d = q.shape
    kv_heads = k.shape[1]
    group = hq // kv_heads
    qg = q.reshape(b, t, kv_heads, group, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    # A fully masked row (a padded query) would give NaN; such rows are discarded by
    # the caller, but keep them finite so NaNs never leak into a reduction.
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)
