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
def decode_steps(params, cache, state, rows=None, *, config, max_len, kv_len, steps, paged_kernel=False):
    """`steps` decode steps. `rows` (`[R]` int32, or None for every slot in order) are the slots
    to compute, padded with `num_slots`: the step then costs R rows, not every slot, which is
    what a drained batch or a paged engine with more slots than running sequences needs (the
    main job's paged engine at cap 128 computed 24 slots for ~7 running ones, 0.61x the slot
    engine's tok/s). Returns `[steps, slots]` tokens (-1 where a slot did not sample)."""
    num_slots = cache.num_slots
    TRACE_COUNTS[("decode", config, kv_len, steps, num_slots, None if rows is None else rows.shape[0])] += 1
    if rows is None:
        slot_ids, view = None, state
    else:
        # Padding rows read the last slot (in bounds, for the attention kernels) but are inactive,
        # so they write nothing, and their state and output scatters go to `num_slots` and drop.
        slot_ids = jnp.minimum(rows, num_slots - 1)
        view = jax.tree.map(lambda a: a[slot_ids], state)
        view = dataclasses.replace(view, active=view.active & (rows < num_slots))

    def one_step(carry, _):
        cache, view = carry
        starts = cache.lengths if slot_ids is None else cache.lengths[slot_ids]
        logits, cache = forward(params, config, cache, view.tokens[:, None], starts,
                                num_valid=view.active.astype(jnp.int32), slot_ids=slot_ids, kv_len=kv_len,
                                logits_index=jnp.zeros_like(view.tokens), paged_kernel=paged_kernel)
        token = sample(logits, view.temperature, view.top_k, view.top_p, view.seeds, view.num_generated)
        generated = view.num_generated + view.active
        done = view.active & is_done(token, view.stop_ids, generated, view.max_tokens, starts + 2, max_len)
        out = jnp.where(view.active, token, -1)
        view = dataclasses.replace(view, tokens=jnp.where(view.active, token, view.tokens),
                                   active=view.active & ~done, num_generated=generated)
        return (cache, view), out

    if steps == 1:  # one step needs no scan (a one-trip while loop around the whole model)
        (cache, view), out = one_step((cache, view), None)
        out = out[None]
    else:
        (cache, view), out = jax.lax.scan(one_step, (cache, view), None, length=steps)
    if rows is None:
        return out, cache, view
    changed = ("tokens", "active", "num_generated")
    state = dataclasses.replace(state, **{f: getattr(state, f).at[rows].set(getattr(view, f), mode="drop")
                                          for f in changed})
    return jnp.full((steps, num_slots), -1, jnp.int32).at[:, rows].set(out, mode="drop"), cache, state


@functools.partial(jax.jit, donate_argnames="state")
def deactivate(state, slot):
    return dataclasses.replace(state, active=state.active.at[slot].set(False))
