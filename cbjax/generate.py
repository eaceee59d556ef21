"""Plain greedy generation over the slot cache: one slot per prompt, decoded together.

This is the foundation's end-to-end path (and the README's first job until the
engine lands): each prompt is prefilled into its own slot, then all slots decode
one token per step until each hits a stop token or its budget.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.checkpoint import Model
from cbjax.kv_cache import SlotCache
from cbjax.models import forward


def next_power_of_two(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _prefill(params, config, cache, tokens, slot, length):
    logits, cache = forward(params, config, cache, tokens[None], jnp.zeros((1,), jnp.int32),
                            num_valid=length[None], slot_ids=slot[None], kv_len=tokens.shape[0],
                            logits_index=length[None] - 1)
    return jnp.argmax(logits[0]).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _decode(params, config, cache, tokens, active):
    logits, cache = forward(params, config, cache, tokens[:, None], cache.lengths,
                            num_valid=active.astype(jnp.int32), logits_index=jnp.zeros_like(tokens))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def greedy_generate(model: Model, prompts: list[list[int]], max_new_tokens: int,
                    stop_token_ids: tuple[int, ...] | None = None, max_len: int | None = None) -> list[list[int]]:
    """Greedy continuations (without the prompt) for each token-id prompt.

    `max_len` fixes the cache length (default: the next power of two that fits), so
    that calls with different budgets can share compiled steps."""
    if not prompts:
        return []
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    config = model.config
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {config.vocab_size}): {bad[:5]}")
    stop = set(config.eos_token_ids if stop_token_ids is None else stop_token_ids)
    longest = max(len(p) for p in prompts)
    max_len = max_len or next_power_of_two(longest + max_new_tokens)
    if longest + max_new_tokens > max_len:
        raise ValueError(f"max_len {max_len} cannot hold {longest} prompt + {max_new_tokens} new tokens")
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt plus max_new_tokens ({longest + max_new_tokens}) exceeds the model's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    dtype = jax.tree.leaves(model.params)[0].dtype
    cache = SlotCache.init(config, len(prompts), max_len, dtype)

    first = []
    for slot, prompt in enumerate(prompts):
        bucket = next_power_of_two(len(prompt))
        padded = np.zeros(bucket, np.int32)
        padded[: len(prompt)] = prompt
        token, cache = _prefill(model.params, config, cache, jnp.asarray(padded), jnp.int32(slot),
                                jnp.int32(len(prompt)))
        first.append(int(token))

    outputs = [[t] for t in first]
    done = np.array([t in stop for t in first]) | (max_new_tokens == 1)
    tokens = jnp.asarray(first, jnp.int32)
    while not done.all():
        tokens, cache = _decode(model.params, config, cache, tokens, jnp.asarray(~done))
        host = np.asarray(tokens)
        for i, t in enumerate(host):
            if not done[i]:
                outputs[i].append(int(t))
                done[i] = t in stop or len(outputs[i]) >= max_new_tokens
    return outputs
