"""Speculative decoding's verification, inside the one ragged step.

A speculating request's row is its last sampled token followed by `k` proposed tokens
(`Row.verify`), computed like a prompt chunk: each token sees the cache and the row's tokens
before it. The step then samples the target's token at every position of the row, exactly as
a decode step would there (the same processors, the same seeded noise: randomness is a
function of the request's seed and the output index), and keeps the longest prefix on which
the target agrees with the proposal, plus the target's own token after it.

For a proposal that is a single token (a point mass q: the n-gram proposer's, and any
greedy draft's), this is the standard rejection sampling: accepting the proposed token with
probability min(1, p/q) = p(token) is drawing from p and comparing, and the residual
normalise(max(0, p - q)) is p conditioned on not drawing it, which is the drawn token when it
differs. So sampled outputs keep the target's distribution exactly, and a seeded request
produces the same tokens with speculation as without (the tests check both).

Rejected positions leave nothing behind: the slot's length moves to the last accepted
position (the keys written past it are overwritten before they are ever read), and the
state, the output counts and the stop test see only accepted tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cbjax.models.ops import XLA, Ops
from cbjax.request import ALL, Sampler
from cbjax.runtime.traced.device_state import is_done, record_tokens
from cbjax.runtime.packed import GENERATED, HEADER, PROMPT_LEN, Resolved
from cbjax.runtime.traced.sampling import count_sampled, sample_next


def grid_tokens(batch: Resolved, positions: int) -> jax.Array:
    """`[R * positions]` the flat token at each (row, position): each position of a verify row
    (its last one repeated past its length), and every other row's last token."""
    num_tokens = batch.inputs.shape[0]
    j = jnp.arange(positions, dtype=jnp.int32)[None, :]
    last = batch.cu_q[1:, None] - 1
    own = batch.cu_q[:-1, None] + jnp.minimum(j, jnp.maximum(batch.q_len[:, None] - 1, 0))
    return jnp.clip(jnp.where(batch.verify[:, None], own, last), 0, num_tokens - 1).reshape(-1)


def at_flat_tokens(batch: Resolved, positions: int) -> bool:
    """Whether the step computes logits at every flat token rather than at each row's
    `positions`: when the token bucket is the smaller (rows proposing fewer than `positions - 1`
    tokens on average). The LM head and the sampler then run on the tokens the call holds, so a
    round's cost follows its proposals, not the longest a row may propose (on a CPU at 4 rows,
    one token each: 8 rows of the head instead of 20)."""
    return batch.inputs.shape[0] < batch.slot.shape[0] * positions


def logits_rows(batch: Resolved, positions: int) -> jax.Array:
    """The flat token indices whose logits the step computes (`sample_positions` reads them
    back): every token (`at_flat_tokens`), or each row's `positions` (`grid_tokens`)."""
    if at_flat_tokens(batch, positions):
        return jnp.arange(batch.inputs.shape[0], dtype=jnp.int32)
    return grid_tokens(batch, positions)


def sample_positions(state, logits, batch: Resolved, flat, ints, floats, *, positions: int, max_len: int,
                     max_logprobs: int, mask=None, ops: Ops = XLA, sampler: Sampler = ALL):
    """Sample each row that ends its prompt or decodes at its last token, and each verify row at
    every position (`logits` at `logits_rows`: each row's positions, or every flat token; one
    position: a step without verify rows, `step.sample_rows`), and update the rows' slots' state; record the prompt
    tokens for the penalties (a request whose logits processors read the history had its
    slot's row cleared before this call: `Engine.record_histories`). Returns `[positions, R, 2]`
    (token or -1, done: a row's accepted tokens, then -1), logprob columns `[positions, R, ...]`
    or None, the state, and `[R]` the tokens each row's sequence holds in the cache now (its new
    length; verify rows only)."""
    num_slots = state.active.shape[0]
    num_rows = ints.shape[0]
    prompt_row = (batch.q_len > 0) & ~batch.decode & ~batch.verify
    row = jnp.minimum(batch.token_row, num_rows - 1)
    state = record_tokens(state, jnp.where(batch.valid & prompt_row[row], batch.token_slot, num_slots), flat[0],
                          batch.token_pos < ints[:, PROMPT_LEN][row])
    slots = jnp.minimum(batch.slot, num_slots - 1)
    rows = state.sampling_rows(slots)
    is_last = batch.is_last
    rows = dataclasses.replace(rows, ints=jnp.where(is_last[:, None], ints[:, HEADER:], rows.ints),
                               floats=jnp.where(is_last[:, None], floats, rows.floats))
    before = jnp.where(is_last, ints[:, GENERATED], rows.num_generated)

    # Every row sampled at every position, as output index `before + j`: each logits row's
    # batch row and position (at flat tokens: a token's row, and its offset in a verify row).
    j = jnp.arange(positions, dtype=jnp.int32)[None, :]
    flat_tokens = positions > 1 and at_flat_tokens(batch, positions)
    if flat_tokens:
        of = jnp.minimum(batch.token_row, num_rows - 1)
        offset = jnp.where(batch.verify[of], jnp.arange(of.shape[0], dtype=jnp.int32) - batch.cu_q[of], 0)
    else:
        of = jnp.repeat(jnp.arange(num_rows, dtype=jnp.int32), positions) if positions > 1 else None
        offset = jnp.tile(j[0], num_rows) if positions > 1 else 0

    def per_logit(a):
        return a if of is None else a[of]

    token, logprobs = sample_next(
        logits, jax.tree.map(per_logit, rows), per_logit(before) + offset, max_logprobs,
        None if mask is None else per_logit(mask),
        history=lambda seen=state.seen, counts=state.counts: (seen[per_logit(slots)], counts[per_logit(slots)]),
        ops=ops, sampler=sampler)
    if flat_tokens:  # back to [row, position]
        grid = grid_tokens(batch, positions)
        token = token[grid]
        logprobs = None if logprobs is None else logprobs[grid]
    token = token.reshape(num_rows, positions)

    # The proposal: a verify row's tokens after its first. Accepted: the leading positions
    # where the target drew the proposed token.
    draft = flat[0][jnp.clip(batch.cu_q[:-1, None] + 1 + j, 0, flat.shape[1] - 1)]
    proposed = batch.verify[:, None] & (j + 1 < batch.q_len[:, None])
    accepted = jnp.sum(jnp.cumprod(proposed & (token == draft), axis=1), axis=1)
    total_len = jnp.where(batch.verify[:, None], batch.start[:, None] + j + 2,
                          (batch.start + batch.q_len)[:, None] + 1 + j)
    samples = (batch.decode & (batch.q_len > 0)) | is_last | batch.verify
    done = is_done(token, rows.stop_ids[:, None, :], before[:, None] + j + 1, rows.max_tokens[:, None], total_len,
                   max_len) & (j <= accepted[:, None]) & samples[:, None]
    stopped = jnp.any(done, axis=1)
    emitted_len = jnp.where(stopped, jnp.argmax(done, axis=1) + 1, accepted + 1)  # [R]
    emitted = j < emitted_len[:, None]
    last = jnp.take_along_axis(token, (emitted_len - 1)[:, None], axis=1)[:, 0]
    target = jnp.where(samples, batch.slot, num_slots)
    state = state.set_rows(target, tokens=last, active=~stopped, num_generated=before + emitted_len, ints=rows.ints,
                           floats=rows.floats)
    counts = state.counts
    for p in range(positions):
        counts = count_sampled(counts, jnp.where(samples & emitted[:, p], batch.slot, num_slots), token[:, p])
    state = dataclasses.replace(state, counts=counts)
    keep = samples[:, None] & emitted
    out = jnp.stack([jnp.where(keep, token, -1), (done & (j == emitted_len[:, None] - 1)).astype(jnp.int32)],
                    axis=-1)
    out = jnp.swapaxes(out, 0, 1)
    if logprobs is not None:
        logprobs = jnp.swapaxes(logprobs.reshape(num_rows, positions, -1), 0, 1)
    return out, logprobs, state, batch.start + emitted_len


def settle_lengths(cache, batch: Resolved, held):
    """The cache's lengths after verification: a verify row's sequence holds its accepted
    positions only (`held`); the keys written past them are never read."""
    lengths = cache.lengths.at[jnp.where(batch.verify, batch.slot, cache.num_slots)].set(held, mode="drop")
    return dataclasses.replace(cache, lengths=lengths)
