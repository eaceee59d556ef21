"""The engine's jitted programs: `prefill_step` (per length bucket, straight into slots) and
`decode_steps` (every active slot, `steps` tokens in one call), compiled separately as in
gpt-fast; the cache and the slot state are donated, so each call updates them in place.

Every program returns one small int32 array the host copies once: prefill `[rows, 2]`
= (first token, done), decode `[steps, slots]` = token or -1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cbjax.models import forward
from cbjax.runtime.device_state import TRACE_COUNTS, is_done
from cbjax.runtime.sampling import sample

# Layout of the packed int32 row that carries one prefill's scalars to the device (one
# host-to-device copy instead of one per scalar: on CPU that was most of a small prefill).
SLOT, START, LENGTH, IS_LAST, MAX_TOKENS, TOP_K, SEED, GENERATED, STOP = range(9)


_STATIC = ("config", "max_len", "kv_len")


@functools.partial(jax.jit, static_argnames=_STATIC + ("first_layer", "embed"), donate_argnames=("cache", "state"))
def prefill_step(params, cache, state, tokens, ints, floats, *, config, max_len, kv_len, first_layer=0, embed=True):
    """Write `B` prompt chunks (`tokens [B, T]`) into their slots; for rows that are the
    last chunk of their prompt, sample the first token and set the slot's decode state
    (a traced flag, so chunked and whole prefills share one program). `ints [B, 7+stops]`
    and `floats [B, 2]` are the packed per-row scalars (see `SLOT` and friends); rows
    with length 0 are batch padding and change nothing."""
    b = tokens.shape[0]
    TRACE_COUNTS[("prefill", config, b, tokens.shape[1], kv_len, cache.num_slots)] += 1
    slot, start, length, max_tokens, top_k, seed, generated = (
        ints[:, i] for i in (SLOT, START, LENGTH, MAX_TOKENS, TOP_K, SEED, GENERATED))
    is_last, stop_ids = (ints[:, IS_LAST] > 0) & (length > 0), ints[:, STOP:]
    temperature, top_p = floats[:, 0], floats[:, 1]
    logits, cache = forward(params, config, cache, tokens, start, num_valid=length, slot_ids=slot, kv_len=kv_len,
                            logits_index=jnp.maximum(length - 1, 0), first_layer=first_layer, embed=embed)
    # A request resumed after preemption has `generated` tokens already: its next token
    # is sampled as output index `generated`, so seeded sampling continues where it was.
    token = sample(logits, temperature, top_k, top_p, seed, generated)
    done = is_done(token, stop_ids, generated + 1, max_tokens, start + length + 1, max_len)
    # Rows that insert nothing scatter to an out-of-range slot, which is dropped.
    state = state.set_rows(jnp.where(is_last, slot, cache.num_slots), token=token, done=done,
                           num_generated=generated + 1, max_tokens=max_tokens, temperature=temperature,
                           top_k=top_k, top_p=top_p, seeds=seed, stop_ids=stop_ids)
    return jnp.stack([token, (done & is_last).astype(jnp.int32)], axis=-1), cache, state


@functools.partial(jax.jit, static_argnames=_STATIC + ("steps", "paged_kernel"), donate_argnames=("cache", "state"))
def decode_steps(params, cache, state, *, config, max_len, kv_len, steps, paged_kernel=False):
    TRACE_COUNTS[("decode", config, kv_len, steps, cache.num_slots)] += 1

    def one_step(carry, _):
        cache, state = carry
        logits, cache = forward(params, config, cache, state.tokens[:, None], cache.lengths,
                                num_valid=state.active.astype(jnp.int32), kv_len=kv_len,
                                logits_index=jnp.zeros_like(state.tokens), paged_kernel=paged_kernel)
        token = sample(logits, state.temperature, state.top_k, state.top_p, state.seeds, state.num_generated)
        generated = state.num_generated + state.active
        done = state.active & is_done(token, state.stop_ids, generated, state.max_tokens, cache.lengths + 1,
                                       max_len)
        out = jnp.where(state.active, token, -1)
        state = dataclasses.replace(state, tokens=jnp.where(state.active, token, state.tokens),
                                    active=state.active & ~done, num_generated=generated)
        return (cache, state), out

    if steps == 1:  # one step needs no scan (a one-trip while loop around the whole model)
        (cache, state), out = one_step((cache, state), None)
        return out[None], cache, state
    (cache, state), out = jax.lax.scan(one_step, (cache, state), None, length=steps)
    return out, cache, state


@functools.partial(jax.jit, donate_argnames="state")
def deactivate(state, slot):
    return dataclasses.replace(state, active=state.active.at[slot].set(False))
