"""The mixed step: prefill chunks and decodes in one jitted program over a flat token buffer.

Orca's fused batches and Sarathi-Serve's chunked prefills need prefill and decode in
the same device call. Here every planned row (a running sequence's decode token, or a
chunk of a prompt) contributes its tokens to one flat buffer of `T` tokens, with
per-token row, position and slot, and per-row metadata (`cu_q_lens` as in JAX's
ragged paged attention). No row is padded to a bucket: the buffer as a whole is, to a
power of two, and the row count to `min(T, slots)`. So a decode step costs what its
active sequences cost, not what the slot count does, and programs are bounded by
(token bucket, attended-length bucket).

Each token runs through the model as its own row (`T = 1` in `forward`), attending
to its slot's cached history (positions before its row's start) and to the new keys
of its own row's tokens up to itself (`flat_rows`); the keys are written after the
last layer. The paged cache can
instead send attention through the ragged Pallas kernel, which loads each page once
per query tile of a row. Rows that end their prompt sample their first token and
start decoding; decode rows read their input token from the device's slot state, so
the host never has to hand it back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.runtime.device_state import TRACE_COUNTS, is_done
from cbjax.models import forward
from cbjax.request import SamplingParams
from cbjax.scheduling.plan import Row
from cbjax.runtime.sampling import sample

# Packed int32 columns of one row (one host-to-device copy for all rows' scalars).
(_SLOT, _START, _QLEN, _IS_DECODE, _IS_LAST, _MAX_TOKENS, _TOP_K, _SEED, _GENERATED, _STOP) = range(10)


def token_buckets(max_tokens: int) -> list[int]:
    """Flat-buffer sizes: powers of two from 1 to the first one holding `max_tokens`."""
    return [1 << i for i in range(max(max_tokens - 1, 0).bit_length() + 1)]


def row_bucket(num_tokens_bucket: int, num_slots: int) -> int:
    """Row count of a flat buffer: every row has a token, and at most one row per slot."""
    return min(num_tokens_bucket, 1 << (num_slots - 1).bit_length())


def pack(rows: list[Row], num_tokens: int, num_rows: int, stop_ids_for) -> tuple[np.ndarray, ...]:
    """Host arrays of a step: tokens, token row, token position `[T]`; row ints `[S, ...]`,
    row floats `[S, 2]`, cu_q_lens `[S + 1]`. Padding tokens point at row S (none)."""
    tokens = np.zeros(num_tokens, np.int32)
    token_row = np.full(num_tokens, num_rows, np.int32)
    token_pos = np.zeros(num_tokens, np.int32)
    stops = len(stop_ids_for(SamplingParams()))
    ints = np.zeros((num_rows, _STOP + stops), np.int32)
    floats = np.zeros((num_rows, 2), np.float32)
    cu_q = np.zeros(num_rows + 1, np.int32)
    t = 0
    for i, row in enumerate(rows):
        n = row.num_tokens
        if row.tokens:
            tokens[t:t + n] = row.tokens
        token_row[t:t + n] = i
        token_pos[t:t + n] = np.arange(row.start, row.start + n)
        ints[i, :_STOP] = (row.slot, row.start, n, row.is_decode, row.is_last, 0, 0, row.seed, row.generated)
        if row.is_last:
            s = row.sampling
            ints[i, _MAX_TOKENS], ints[i, _TOP_K] = s.max_tokens, s.top_k
            ints[i, _STOP:] = stop_ids_for(s)
            floats[i] = (s.temperature, s.top_p)
        t += n
        cu_q[i + 1] = t
    cu_q[len(rows) + 1:] = t
    return tokens, token_row, token_pos, ints, floats, cu_q


@functools.partial(jax.jit, static_argnames=("config", "max_len", "kv_len", "paged_kernel"),
                   donate_argnames=("cache", "state"))
def mixed_step(params, cache, state, tokens, token_row, token_pos, ints, floats, cu_q, *, config, max_len, kv_len,
               paged_kernel=False):
    """Returns `[S, 2]` int32 (sampled token or -1, done) per row, the cache, the state."""
    num_rows, num_tokens = ints.shape[0], tokens.shape[0]
    TRACE_COUNTS[("mixed", config, num_tokens, kv_len, cache.num_slots)] += 1
    slot, start, q_len, is_decode, is_last, generated = (
        ints[:, i] for i in (_SLOT, _START, _QLEN, _IS_DECODE, _IS_LAST, _GENERATED))
    is_decode, is_last = (is_decode > 0) & (q_len > 0), (is_last > 0) & (q_len > 0)
    valid = token_row < num_rows
    row = jnp.minimum(token_row, num_rows - 1)
    token_slot = slot[row]
    inputs = jnp.where(valid & is_decode[row], state.tokens[token_slot], tokens)
    last_token = jnp.clip(cu_q[1:] - 1, 0, num_tokens - 1)  # each row's last token
    ragged = (cu_q, start + q_len, slot) if paged_kernel else None
    logits, cache = forward(params, config, cache, inputs[:, None], token_pos, num_valid=valid.astype(jnp.int32),
                            slot_ids=token_slot, kv_len=kv_len, logits_rows=last_token, paged_kernel=paged_kernel,
                            ragged=ragged, flat_rows=token_row, history_end=start[row])
    # Several tokens of one slot set its length in any order; one write per row settles it.
    lengths = cache.lengths.at[jnp.where(q_len > 0, slot, cache.num_slots)].set(start + q_len, mode="drop")
    cache = dataclasses.replace(cache, lengths=lengths)

    # Sampling parameters: a row ending its prompt brings its own; a decode row's live on the device.
    def own_or_slot(own, field):
        return jnp.where(is_last if own.ndim == 1 else is_last[:, None], own, field[slot])

    temperature, top_p = own_or_slot(floats[:, 0], state.temperature), own_or_slot(floats[:, 1], state.top_p)
    top_k, seeds = own_or_slot(ints[:, _TOP_K], state.top_k), own_or_slot(ints[:, _SEED], state.seeds)
    max_tokens = own_or_slot(ints[:, _MAX_TOKENS], state.max_tokens)
    stop_ids = own_or_slot(ints[:, _STOP:], state.stop_ids)
    before = jnp.where(is_last, generated, state.num_generated[slot])
    token = sample(logits, temperature, top_k, top_p, seeds, before)
    samples = is_decode | is_last
    done = is_done(token, stop_ids, before + 1, max_tokens, start + q_len + 1, max_len) & samples
    state = state.set_rows(jnp.where(samples, slot, cache.num_slots), token=token, done=done,
                           num_generated=before + 1, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seeds=seeds, stop_ids=stop_ids)
    out = jnp.stack([jnp.where(samples, token, -1), done.astype(jnp.int32)], axis=-1)
    return out, cache, state
