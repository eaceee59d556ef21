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


_MASKED = -1e30  # finite, so a fully masked (padding) row stays finite instead of NaN


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
    if t == 1:
        return _single_query_attention(q.reshape(b, kv_heads, group, d), k, v, mask[:, 0], scale).reshape(q.shape)
    qg = q.reshape(b, t, kv_heads, group, d)
    # XLA:CPU has no batched bf16 x bf16 -> f32 dot (it fails once a prefill batches two or
    # more rows), so on the CPU low-precision operands are widened first; accelerators
    # keep them narrow and accumulate in f32.
    operand = jnp.float32 if jax.default_backend() == "cpu" else None
    qg, k = (x.astype(operand or x.dtype) for x in (qg, k))
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(operand or v.dtype), v.astype(operand or v.dtype),
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _single_query_attention(q, k, v, mask, scale):
    """Decode: one query per row. Written as multiply-and-reduce rather than a batched
    matmul: with a handful of query heads per KV head the dot is a skinny [group, d] x
    [d, K] product, which XLA's CPU backend runs 2.5x slower than the fused
    elementwise reduction (measured at 32 slots, K=256); both stream K and V once."""
    qf = q.astype(jnp.float32)
    scores = jnp.sum(qf[:, :, :, None, :] * k[:, :, None, :, :].astype(jnp.float32), axis=-1) * scale
    scores = jnp.where(mask[:, None, None, :], scores, _MASKED)  # [B, kv_heads, group, K]
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.sum(probs.astype(v.dtype)[..., None] * v[:, :, None, :, :], axis=-2, dtype=jnp.float32)
    return out.astype(q.dtype)
