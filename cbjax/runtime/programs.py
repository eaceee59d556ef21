"""The engine's jitted programs: `prefill_step` (per length bucket, straight into slots) and
`decode_steps` (every active slot, `steps` tokens in one call), compiled separately as in
gpt-fast; the cache and the slot state are donated, so each call updates them in place.

Every program returns one small int32 array the host copies once: prefill `[rows, 2]`
= (first token, done), decode `[steps, slots]` = token or -1; an engine that computes
logprobs (`max_logprobs > 0`) gets a float32 array of logprob columns beside it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cbjax.models import forward
from cbjax.models.kv_cache import PagedCache
from cbjax.runtime.device_state import TRACE_COUNTS, is_done, record_tokens, sampling_fields
from cbjax.runtime.sampling import count_sampled, sample_next

# Layout of the packed int32 row that carries one prefill's scalars to the device (one
# host-to-device copy instead of one per scalar: on CPU that was most of a small prefill),
# followed by the row's sampling parameters (device_state.sampling_fields).
SLOT, START, LENGTH, IS_LAST, GENERATED, PROMPT_LEN = range(6)
HEADER = 6


_STATIC = ("config", "max_len", "kv_len", "max_logprobs")


def with_logprobs(out, logprobs):
    """A program's packed result, with the logprob columns beside it when the engine computes them."""
    return out if logprobs is None else (out, logprobs)


def split_logprobs(out):
    """A program's result and its logprob columns (None when the engine computes none)."""
    return out if isinstance(out, tuple) else (out, None)


@functools.partial(jax.jit, static_argnames=_STATIC + ("first_layer", "embed"), donate_argnames=("cache", "state"))
def prefill_step(params, cache, state, tokens, ints, floats, hidden=None, *, config, max_len, kv_len,
                 max_logprobs=0, first_layer=0, embed=True):
    """Write `B` prompt chunks (`tokens [B, T]`) into their slots; for rows that are the
    last chunk of their prompt, sample the first token and set the slot's decode state
    (a traced flag, so chunked and whole prefills share one program). `ints [B, HEADER +
    ...]` and `floats` are the packed per-row scalars (see `SLOT` and friends); rows with
    length 0 are batch padding and change nothing. `hidden`: a pipeline's last stage takes
    the previous stage's activations (`embed=False`) and still needs the token ids."""
    b, t = tokens.shape
    num_slots = cache.num_slots
    TRACE_COUNTS[("prefill", config, b, t, kv_len, num_slots)] += 1
    slot, start, length, generated, prompt_len = (
        ints[:, i] for i in (SLOT, START, LENGTH, GENERATED, PROMPT_LEN))
    is_last = (ints[:, IS_LAST] > 0) & (length > 0)
    fields = sampling_fields(ints[:, HEADER:], floats, state.stop_ids.shape[1])
    logits, cache = forward(params, config, cache, tokens if hidden is None else hidden, start, num_valid=length,
                            slot_ids=slot, kv_len=kv_len, logits_index=jnp.maximum(length - 1, 0),
                            first_layer=first_layer, embed=embed)
    position = start[:, None] + jnp.arange(t)
    valid = jnp.arange(t) < length[:, None]
    state = record_tokens(state, jnp.where((start == 0) & (length > 0), slot, num_slots),
                          jnp.where(valid, slot[:, None], num_slots), tokens, position < prompt_len[:, None])
    rows = dataclasses.replace(state.rows(jnp.minimum(slot, num_slots - 1)), **fields)
    # A request resumed after preemption has `generated` tokens already: its next token
    # is sampled as output index `generated`, so seeded sampling continues where it was.
    token, logprobs = sample_next(logits, rows, generated, max_logprobs)
    done = is_done(token, fields["stop_ids"], generated + 1, fields["max_tokens"], start + length + 1, max_len)
    # Rows that insert nothing scatter to an out-of-range slot, which is dropped.
    state = state.set_rows(jnp.where(is_last, slot, num_slots), tokens=token, active=~done,
                           num_generated=generated + 1, counts=count_sampled(rows.counts, token, is_last), **fields)
    out = jnp.stack([token, (done & is_last).astype(jnp.int32)], axis=-1)
    return with_logprobs(out, logprobs), cache, state


@functools.partial(jax.jit, static_argnames=_STATIC + ("steps", "paged_kernel"), donate_argnames=("cache", "state"))
def decode_steps(params, cache, state, rows=None, *, config, max_len, kv_len, steps, max_logprobs=0,
                 paged_kernel=False):
    """`steps` decode steps. `rows` (`[R]` int32, or None for every slot in order) are the slots
    to compute, padded with `num_slots`: the step then costs R rows, not every slot, which is
    what a drained batch or a paged engine with more slots than running sequences needs (the
    main job's paged engine at cap 128 computed 24 slots for ~7 running ones, 0.61x the slot
    engine's tok/s). Returns `[steps, slots]` tokens (-1 where a slot did not sample), with
    `[steps, slots, 1 + 2 max_logprobs]` logprob columns when `max_logprobs`."""
    num_slots = cache.num_slots
    TRACE_COUNTS[("decode", config, kv_len, steps, num_slots, None if rows is None else rows.shape[0])] += 1
    if rows is None:
        slot_ids, view = None, state
    else:
        # Padding rows read the last slot (in bounds, for the attention kernels) but are inactive,
        # so they write nothing, and their state and output scatters go to `num_slots` and drop.
        slot_ids = jnp.minimum(rows, num_slots - 1)
        view = state.rows(slot_ids)
        view = dataclasses.replace(view, active=view.active & (rows < num_slots))

    def one_step(carry, _):
        cache, view = carry
        starts = cache.lengths if slot_ids is None else cache.lengths[slot_ids]
        logits, cache = forward(params, config, cache, view.tokens[:, None], starts,
                                num_valid=view.active.astype(jnp.int32), slot_ids=slot_ids, kv_len=kv_len,
                                logits_index=jnp.zeros_like(view.tokens), paged_kernel=paged_kernel)
        token, logprobs = sample_next(logits, view, view.num_generated, max_logprobs)
        generated = view.num_generated + view.active
        done = view.active & is_done(token, view.stop_ids, generated, view.max_tokens, starts + 2, max_len)
        out = jnp.where(view.active, token, -1)
        view = dataclasses.replace(view, tokens=jnp.where(view.active, token, view.tokens),
                                   active=view.active & ~done, num_generated=generated,
                                   counts=count_sampled(view.counts, token, view.active))
        return (cache, view), (out, logprobs)

    if steps == 1:  # one step needs no scan (a one-trip while loop around the whole model)
        (cache, view), out = one_step((cache, view), None)
        out = jax.tree.map(lambda a: a[None], out)
    else:
        (cache, view), out = jax.lax.scan(one_step, (cache, view), None, length=steps)
    out, logprobs = out
    if rows is None:
        return with_logprobs(out, logprobs), cache, view
    changed = ("tokens", "active", "num_generated", "counts")
    state = dataclasses.replace(state, **{f: getattr(state, f).at[rows].set(getattr(view, f), mode="drop")
                                          for f in changed})
    out = jnp.full((steps, num_slots), -1, jnp.int32).at[:, rows].set(out, mode="drop")
    if logprobs is not None:
        logprobs = jnp.zeros((steps, num_slots, logprobs.shape[-1]), jnp.float32).at[:, rows].set(logprobs,
                                                                                                  mode="drop")
    return with_logprobs(out, logprobs), cache, state


@functools.partial(jax.jit, donate_argnames="cache")
def copy_kv(cache, src, dst):
    """Copy keys and values from `src` to `dst` (`[N]` int32, `dst` padded with an out-of-range
    id): whole slots of a `SlotCache`, pages of a `PagedCache` (a fork's copy on write)."""
    axis = 1 if isinstance(cache, PagedCache) else 0

    def copy(layer):
        index = (slice(None),) * axis
        return layer.at[index + (dst,)].set(layer[index + (src,)], mode="drop")

    return dataclasses.replace(cache, k=tuple(map(copy, cache.k)), v=tuple(map(copy, cache.v)))


@functools.partial(jax.jit, donate_argnames="state")
def record_history(state, slot, tokens, prompt_len):
    """A request that starts at a position past 0 (cached prefix pages, or a fork of a
    sibling's prompt) brings the tokens before it (`tokens`, -1 padded to a bucket): its
    penalties' history is set from them."""
    valid = tokens >= 0
    num_slots = state.seen.shape[0]
    return record_tokens(state, slot[None], jnp.where(valid, slot, num_slots), jnp.maximum(tokens, 0),
                         jnp.arange(tokens.shape[0]) < prompt_len)


@functools.partial(jax.jit, donate_argnames="state")
def deactivate(state, slot):
    return dataclasses.replace(state, active=state.active.at[slot].set(False))
