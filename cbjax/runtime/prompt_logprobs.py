"""Prompt log-probabilities (vLLM's `prompt_logprobs`, the completions API's `echo` with
`logprobs`): the model over a whole prompt at once, outside the batched step, with each
position's log-softmax.

The batched step computes logits only at each row's last token, so a request that asks for
its prompt's distribution pays one more forward over the prompt, compiled per power-of-two
prompt length (cached persistently like every program): a research engine's choice, where
vLLM keeps every prefill position's logits inside its step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.models import forward
from cbjax.models.kv_cache import SlotCache
from cbjax.request import TokenLogprob


@functools.partial(jax.jit, static_argnames=("config", "k"))
def _columns(params, config, tokens, length, *, k: int):
    """`[N - 1, 2 + 2k]` float32 for positions 1..N-1: the prompt token's log-probability given
    the tokens before it, its rank (1 = likeliest), the top k log-probabilities and their ids."""
    cache = SlotCache.init(config, 1, tokens.shape[0], jax.tree.leaves(params)[0].dtype)
    logits, _ = forward(params, config, cache, tokens[None], jnp.zeros((1,), jnp.int32), num_valid=length[None])
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[1:, None], axis=-1)
    rank = 1 + jnp.sum(logp > chosen, axis=-1, keepdims=True).astype(jnp.float32)
    top, ids = jax.lax.top_k(logp, k) if k else (logp[:, :0], jnp.zeros((logp.shape[0], 0), jnp.int32))
    return jnp.concatenate([chosen, rank, top, ids.astype(jnp.float32)], axis=-1)


def prompt_logprobs(params, config, ids: list[int], k: int) -> list[TokenLogprob | None]:
    """Each prompt token's `TokenLogprob` (with its rank and the k likeliest tokens at that
    position); None for the first, which nothing predicts."""
    size = 1 << max(len(ids) - 1, 1).bit_length()
    padded = np.zeros(size, np.int32)
    padded[:len(ids)] = ids
    columns = np.asarray(jax.device_get(_columns(params, config, padded, np.int32(len(ids)), k=k)))
    out: list[TokenLogprob | None] = [None]
    for token, row in zip(ids[1:], columns):
        top = tuple((int(i), float(v)) for v, i in zip(row[2:2 + k], row[2 + k:2 + 2 * k]))
        out.append(TokenLogprob(token, float(row[0]), top, rank=int(row[1])))
    return out
