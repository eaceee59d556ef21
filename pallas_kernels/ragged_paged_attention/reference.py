"""Pure-JAX ragged paged attention: the reference the kernel is checked against.

The layout of JAX's TPU `ragged_paged_attention`: a flat buffer of query tokens in
which sequence `s` owns rows `[cu_q_lens[s], cu_q_lens[s + 1])`, its new tokens; its
keys and values, new ones included (already written), are the first `kv_lens[s]`
positions of its pages `page_indices[s]`. Query i of sequence s sits at position
`kv_lens[s] - q_len[s] + i` and sees keys up to there (causal); with a sliding `window`
of w > 0, only the keys in `(position - w, position]` (transformers' rule). Rows past
the last sequence are padding and come out as zeros. K and V may be 8-bit pools with a
float32 scale per key (values `[kv_heads, num_pages, page_size, head_dim]`, scale
`[kv_heads, num_pages, page_size, 1]`: cbjax's `QuantizedKV`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _gather(pool, pages: jax.Array) -> jax.Array:
    """`pool[:, pages]` in float32; an 8-bit pool (values and a scale per key) dequantized."""
    if hasattr(pool, "scale"):
        return pool.values[:, pages].astype(jnp.float32) * pool.scale[:, pages]
    return pool[:, pages].astype(jnp.float32)


# One program per shape, not one per op: called outside a jit (the tests), op-by-op dispatch
# compiled each of its ~25 ops for every new shape.
@functools.partial(jax.jit, static_argnames=("scale", "window"))
def reference(
    q: jax.Array,  # [T, q_heads, head_dim]
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    scale: float,
    window: int = 0,
) -> jax.Array:
    """`[T, q_heads, head_dim]` in q's dtype, computed in float32."""
    num_tokens, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs = kv_lens.shape[0]
    group = q_heads // kv_heads
    t = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_seqs - 1)
    valid = t < cu_q_lens[-1]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + (t - cu_q_lens[seq])  # [T]
    pages = jnp.clip(page_indices[seq], 0, num_pages - 1)  # [T, pages_per_seq]
    k, v = (_gather(pages_, pages).reshape(kv_heads, num_tokens, -1, head_dim).swapaxes(0, 1)
            for pages_ in (k_pages, v_pages))
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).astype(jnp.float32)
    logits = jnp.einsum("tkgd,tksd->tkgs", qg, k) * scale
    key = jnp.arange(k.shape[2])[None, :]
    visible = (key <= position[:, None]) & valid[:, None]  # [T, keys]
    if window:
        visible &= key > position[:, None] - window
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(visible[:, None, None, :], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(-1, keepdims=True)
    out = jnp.einsum("tkgs,tksd->tkgd", p, v) / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(num_tokens, q_heads, head_dim).astype(q.dtype)
