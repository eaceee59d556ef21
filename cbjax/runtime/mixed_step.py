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

from cbjax.runtime.device_state import TRACE_COUNTS, is_done, record_tokens, sampling_fields
from cbjax.models import forward
from cbjax.runtime.programs import with_logprobs
from cbjax.scheduling.plan import Row
from cbjax.runtime.sampling import count_sampled, sample_next

# Packed int32 columns of one row (one host-to-device copy for all rows' scalars), then the
# sampling parameters of a row that ends its prompt (device_state.sampling_fields).
(_SLOT, _START, _QLEN, _IS_DECODE, _IS_LAST, _GENERATED, _PROMPT_LEN) = range(7)
_HEADER = 7


def token_buckets(max_tokens: int) -> list[int]:
    """Flat-buffer sizes: powers of two from 1 to the first one holding `max_tokens`."""
    return [1 << i for i in range(max(max_tokens - 1, 0).bit_length() + 1)]


def row_bucket(num_tokens_bucket: int, num_slots: int) -> int:
    """Row count of a flat buffer: every row has a token, and at most one row per slot."""
    return min(num_tokens_bucket, 1 << (num_slots - 1).bit_length())


def pack(rows: list[Row], num_tokens: int, num_rows: int, sampling_row) -> tuple[np.ndarray, ...]:
    """Host arrays of a step: tokens, token row, token position `[T]`; row ints, row floats
    `[S, ...]`, cu_q_lens `[S + 1]`. Padding tokens point at row S (none). `sampling_row(row)`
    packs a row's sampling parameters (`Engine.sampling_row`)."""
    tokens = np.zeros(num_tokens, np.int32)
    token_row = np.full(num_tokens, num_rows, np.int32)
    token_pos = np.zeros(num_tokens, np.int32)
    blank_ints, blank_floats = sampling_row(None)
    ints = np.zeros((num_rows, _HEADER + len(blank_ints)), np.int32)
    ints[:, _HEADER:] = blank_ints
    floats = np.tile(blank_floats, (num_rows, 1))
    cu_q = np.zeros(num_rows + 1, np.int32)
    t = 0
    for i, row in enumerate(rows):
        n = row.num_tokens
        if row.tokens:
            tokens[t:t + n] = row.tokens
        token_row[t:t + n] = i
        token_pos[t:t + n] = np.arange(row.start, row.start + n)
        ints[i, :_HEADER] = (row.slot, row.start, n, row.is_decode, row.is_last, row.generated, row.prompt_len)
        if row.is_last:
            ints[i, _HEADER:], floats[i] = sampling_row(row)
        t += n
        cu_q[i + 1] = t
    cu_q[len(rows) + 1:] = t
    return tokens, token_row, token_pos, ints, floats, cu_q


@functools.partial(jax.jit, static_argnames=("config", "max_len", "kv_len", "max_logprobs", "paged_kernel"),
                   donate_argnames=("cache", "state"))
def mixed_step(params, cache, state, tokens, token_row, token_pos, ints, floats, cu_q, *, config, max_len, kv_len,
               max_logprobs=0, paged_kernel=False):
    """Returns `[S, 2]` int32 (sampled token or -1, done) per row (with `[S, 1 + 2 max_logprobs]`
    logprob columns when `max_logprobs`), the cache, the state."""
    num_rows, num_tokens = ints.shape[0], tokens.shape[0]
    num_slots = cache.num_slots
    TRACE_COUNTS[("mixed", config, num_tokens, kv_len, num_slots)] += 1
    slot, start, q_len, is_decode, is_last, generated, prompt_len = (
        ints[:, i] for i in (_SLOT, _START, _QLEN, _IS_DECODE, _IS_LAST, _GENERATED, _PROMPT_LEN))
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
    lengths = cache.lengths.at[jnp.where(q_len > 0, slot, num_slots)].set(start + q_len, mode="drop")
    cache = dataclasses.replace(cache, lengths=lengths)
    prompt_row = (q_len > 0) & ~is_decode
    state = record_tokens(state, jnp.where(prompt_row & (start == 0), slot, num_slots),
                          jnp.where(valid & prompt_row[row], token_slot, num_slots), tokens,
                          token_pos < prompt_len[row])

    # Sampling parameters: a row ending its prompt brings its own; a decode row's live on the device.
    rows = state.rows(jnp.minimum(slot, num_slots - 1))
    own = sampling_fields(ints[:, _HEADER:], floats, state.stop_ids.shape[1])
    rows = dataclasses.replace(rows, **{name: jnp.where(is_last.reshape((-1,) + (1,) * (value.ndim - 1)), value,
                                                        getattr(rows, name)) for name, value in own.items()})
    before = jnp.where(is_last, generated, rows.num_generated)
    token, logprobs = sample_next(logits, rows, before, max_logprobs)
    samples = is_decode | is_last
    done = is_done(token, rows.stop_ids, before + 1, rows.max_tokens, start + q_len + 1, max_len) & samples
    state = state.set_rows(jnp.where(samples, slot, num_slots), tokens=token, active=~done, num_generated=before + 1,
                           counts=count_sampled(rows.counts, token, samples),
                           **{name: getattr(rows, name) for name in own})
    out = jnp.stack([jnp.where(samples, token, -1), done.astype(jnp.int32)], axis=-1)
    return with_logprobs(out, logprobs), cache, state
