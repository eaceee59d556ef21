"""On-device sampling, one set of parameters per slot: greedy, temperature, top-k, top-p.

Randomness is a function of (request seed, index of the token in the output), so a
seeded request samples the same tokens whatever batch or slot it lands in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _sample_row(logits, temperature, top_k, top_p, seed, index):
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    # One descending sort serves both top-k (a rank cut) and top-p (a mass cut).
    neg_sorted, order = jax.lax.sort_key_val(-scaled, jnp.arange(vocab, dtype=jnp.int32))
    sorted_logits = -neg_sorted
    rank = jnp.arange(vocab)
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    keep &= (jnp.cumsum(probs) - probs) < top_p  # the top token always survives
    # The draw happens in vocabulary order, so each token id gets its own noise: the same
    # seed picks the same token whenever the distribution is the same, even where a 1e-7
    # difference between two near-equal logits would swap their ranks.
    keep_by_id = jnp.zeros((vocab,), bool).at[order].set(keep)
    key = jax.random.fold_in(jax.random.key(seed), index)
    return jax.random.categorical(key, jnp.where(keep_by_id, scaled, -jnp.inf)).astype(jnp.int32)


def sample(
    logits: jax.Array,  # [S, V] float32
    temperature: jax.Array,  # [S] float32, 0 = greedy
    top_k: jax.Array,  # [S] int32, 0 = off
    top_p: jax.Array,  # [S] float32, 1 = off
    seeds: jax.Array,  # [S] int32
    indices: jax.Array,  # [S] int32: index of the token being sampled in its output
) -> jax.Array:
    """Next token per row, `[S]` int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic(_):
        drawn = jax.vmap(_sample_row)(logits, temperature, top_k, top_p, seeds, indices)
        return jnp.where(temperature > 0, drawn, greedy)

    # The sort is the expensive part: skip it when every row is greedy.
    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)
