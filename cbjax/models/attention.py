"""Attention as two parts merged by their softmax statistics: the keys already in the cache
(the history, positions before the chunk) and the chunk's own new keys.

Splitting them lets a fresh prefill read no cache at all (its history is empty) and lets
the tokens of one sequence in the mixed step's flat buffer share their new keys, instead
of each token gathering its own copy of the sequence's keys from the cache.

Each part returns its unnormalised output with the running max and sum of its
exponentials (flash attention's bookkeeping), so merging is exact: the result is the
softmax over the union of the keys. Scores and sums are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a fully masked (padding) row stays finite instead of NaN


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """Causal (optionally sliding-window) visibility of key positions to query positions,
    broadcast over their shapes. `window` 0 is full attention; otherwise a query at p sees
    keys in (p - window, p], as in transformers."""
    ok = k_pos <= q_pos
    return ok & (k_pos > q_pos - window) if window else ok


def attention_part(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, scale: float):
    """One part of the attention.

    q `[B, T, q_heads, d]`; keys and values `[B, kv_heads, K, d]`; mask `[B, T, K]`.
    Returns (out `[B, kv_heads, group, T, d]` unnormalised, max and sum `[B, kv_heads, group, T]`).
    """
    b, t, hq, d = q.shape
    kv_heads = keys.shape[1]
    group = hq // kv_heads
    qg = q.reshape(b, t, kv_heads, group, d)
    visible_mask = mask[:, None, None, :, :]
    if t == 1:
        # A single query per row is a skinny [group, d] x [d, K] product, which XLA:CPU runs
        # slower as a dot than as this fused multiply-and-reduce (docs/code_measurements.md);
        # both stream the keys once.
        qf = qg[:, 0].astype(jnp.float32)
        scores = jnp.sum(qf[:, :, :, None, :] * keys[:, :, None, :, :].astype(jnp.float32), axis=-1)[:, :, :, None]
    else:
        # XLA:CPU has no batched bf16 x bf16 -> f32 dot, so there low-precision operands are
        # widened first; accelerators keep them narrow and accumulate in f32.
        operand = jnp.float32 if jax.default_backend() == "cpu" else q.dtype
        scores = jnp.einsum("btkgd,bksd->bkgts", qg.astype(operand), keys.astype(operand),
                            preferred_element_type=jnp.float32)
    scores = jnp.where(visible_mask, scores * scale, _MASKED)
    top = jnp.max(scores, axis=-1)
    probs = jnp.where(visible_mask, jnp.exp(scores - top[..., None]), 0.0)
    total = jnp.sum(probs, axis=-1)
    if t == 1:
        out = jnp.sum(probs[:, :, :, 0, :, None] * values[:, :, None].astype(jnp.float32), axis=-2)[:, :, :, None]
    else:
        operand = jnp.float32 if jax.default_backend() == "cpu" else values.dtype
        out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(operand), values.astype(operand),
                         preferred_element_type=jnp.float32)
    return out, top, total


def merge_parts(parts, q_shape, dtype) -> jax.Array:
    """Combine `attention_part` results over disjoint key sets: `[B, T, q_heads, d]`."""
    top = parts[0][1]
    for _, m, _ in parts[1:]:
        top = jnp.maximum(top, m)
    out = total = 0.0
    for o, m, s in parts:
        rescale = jnp.exp(m - top)
        out = out + o * rescale[..., None]
        total = total + s * rescale
    out = out / jnp.maximum(total, 1e-30)[..., None]  # an all-padding row divides 0 by 1e-30
    b, kv_heads, group, t, d = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(q_shape).astype(dtype)


def flat_self_part(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float):
    """The new-key part of a flat token buffer (the mixed step: `N` tokens, one per row of
    q/k/v `[N, 1, heads, d]`): each token attends to the new keys of its own sequence,
    `mask [N, N]`. Returns `attention_part`'s triple in the per-token layout."""
    out, top, total = attention_part(q[:, 0][None], k[:, 0][None].swapaxes(1, 2), v[:, 0][None].swapaxes(1, 2),
                                     mask[None], scale)
    # [1, kv_heads, group, N, ...] -> [N, kv_heads, group, 1, ...]
    return (jnp.moveaxis(out[0], 2, 0)[:, :, :, None], jnp.moveaxis(top[0], 2, 0)[..., None],
            jnp.moveaxis(total[0], 2, 0)[..., None])
