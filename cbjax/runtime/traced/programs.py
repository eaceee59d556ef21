"""The engine's small jitted programs beside the step (step.py): KV copies between slots or
pages, the penalties' history of a request that starts past position 0, and deactivating a
slot (abort, preemption)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cbjax.runtime.traced import device_state


@functools.partial(jax.jit, donate_argnames="cache")
def copy_kv(cache, src, dst):
    """Copy keys and values from `src` to `dst` (`[N]` int32, `dst` padded with an out-of-range
    id): whole slots of a `SlotCache`, pages of a `PagedCache` (a fork's copy on write)."""
    def copy(layer):
        return cache.copy(layer, src, dst)

    return dataclasses.replace(cache, k=tuple(map(copy, cache.k)), v=tuple(map(copy, cache.v)))


@functools.partial(jax.jit, donate_argnames="state")
def record_history(state, slot, tokens, prompt_len):
    """Slot `slot`'s penalties' history cleared, then set from the tokens before the request's
    start (`tokens`, -1 padded to a bucket; all -1 at position 0): a request past position 0
    (cached prefix pages, a fork of a sibling's prompt) brings them."""
    valid = tokens >= 0
    num_slots = state.seen.shape[0]
    return device_state.record_tokens(device_state.clear_history(state, slot), jnp.where(valid, slot, num_slots),
                                      jnp.maximum(tokens, 0), jnp.arange(tokens.shape[0]) < prompt_len)


@functools.partial(jax.jit, donate_argnames="state")
def deactivate(state, slot):
    return dataclasses.replace(state, active=state.active.at[slot].set(False))
