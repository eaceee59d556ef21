"""The one device step: a ragged batch of rows over a flat token buffer. Everything here runs
inside the compiled program; the host side of its inputs (the rows packed into a few small
arrays, the sampling checks, the result's copy back) is packing.py.

Every round runs through `ragged_step`, whatever it holds: a decode row is one token of a
running sequence, a prefill row a chunk of a prompt (a whole prompt is one chunk). The
rows' tokens lie end to end in one buffer of `N` tokens (a token bucket) with at most
`R = min(N, slots)` rows, so the programs are keyed by the token bucket alone: attended
lengths and positions are data, never shapes (tpu-inference's ragged paged attention
makes the same choice). `prefill_first`, `fused` and `chunked` are ways the scheduler
fills this step: prompt rows alone and then decode rows alone, or both in one call.

Each token runs through the model as its own row of one (`T = 1` in `forward`), seeing its
slot's cached history (positions before its row's start, read up to the longest history
in the batch, in blocks) and the new keys of its own row up to itself (`flat_rows`).
A decode row carries no token and no position from the host: it reads its slot's last
sampled token and the slot's length from the device, so the host may dispatch the next
decode before it has read this one's tokens, and a row whose slot finished meanwhile
computes nothing. Rows that end a prompt or decode sample a token; the result is one
int32 array `[steps, R, 2]` = (token or -1, done), the one copy the host makes. A speculating
request's row (a verify row: its last token and proposed ones) is sampled at every position
by the program compiled with `verify`, whose result is `[1 + k, R, 2]` (speculative.py).
A call whose prompt rows score their prompt (`SamplingParams.prompt_logprobs`) names the
tokens to score and their next prompt tokens (`scored`); its program computes the LM head at
those tokens too and returns their `score_columns` beside the result (cbjax/prompt_scores.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cbjax.models import forward
from cbjax.models.ops import XLA
from cbjax.request import ALL, Sampler
from cbjax.runtime.traced.device_state import TRACE_COUNTS
from cbjax.runtime.traced import speculative
from cbjax.runtime.packed import Resolved, resolve



def score_columns(logits, targets, k: int):
    """`[N, 2 + 2k]` float32 for logits `[N, vocab]` and `targets [N]` (-1: none): the target's
    log-probability, its rank (1 = likeliest), the top k log-probabilities and their ids."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], axis=-1)
    rank = 1 + jnp.sum(logp > chosen, axis=-1, keepdims=True).astype(jnp.float32)
    top, ids = jax.lax.top_k(logp, k) if k else (logp[:, :0], jnp.zeros((logp.shape[0], 0), jnp.int32))
    return jnp.concatenate([chosen, rank, top, ids.astype(jnp.float32)], axis=-1)


def run_layers(params, config, cache, batch: Resolved, *, hidden=None, attention_kernel=False, history_block=None,
               first_layer=0, embed=True, head=True, ops=XLA, verify=0, routing=False, score_at=None):
    """The model over a resolved batch: logits `[R, vocab]` at each row's last token (or, with
    `head=False`, the hidden states of every token), and the cache with the keys written.
    `verify`: logits `[R * verify, vocab]` at each position of verify rows (speculative.py).
    `score_at [S]`: flat token indices whose logits follow those, `[S, vocab]` more rows.
    `routing`: a third result, the tokens each MoE layer sent to each expert (`forward`)."""
    num_tokens, num_rows = batch.inputs.shape[0], batch.slot.shape[0]
    last_token = (speculative.logits_rows(batch, verify) if verify
                  else jnp.clip(batch.cu_q[1:] - 1, 0, num_tokens - 1))
    if score_at is not None:
        last_token = jnp.concatenate([last_token, score_at])
    ragged = (batch.cu_q, batch.start + batch.q_len, jnp.minimum(batch.slot, cache.num_slots - 1)) \
        if attention_kernel else None
    x = batch.inputs[:, None] if hidden is None else hidden
    out, cache, *expert_tokens = forward(
        params, config, cache, x, batch.token_pos, num_valid=batch.valid.astype(jnp.int32), slot_ids=batch.token_slot,
        kv_len=cache.max_len, logits_rows=last_token, attention_kernel=attention_kernel, ragged=ragged,
        flat_rows=batch.token_row, history_end=batch.start[jnp.minimum(batch.token_row, num_rows - 1)],
        history_block=history_block, first_layer=first_layer, embed=embed, head=head, ops=ops, routing=routing,
        adapters=batch.token_adapter)
    # Several tokens of one slot set its length in any order; one write per row settles it.
    lengths = cache.lengths.at[jnp.where(batch.q_len > 0, batch.slot, cache.num_slots)].set(
        batch.start + batch.q_len, mode="drop")
    return (out, dataclasses.replace(cache, lengths=lengths), *expert_tokens)


def sample_rows(state, logits, batch: Resolved, flat, ints, floats, *, max_len, max_logprobs, mask=None, ops=XLA,
                sampler: Sampler = ALL):
    """Sample each row that ends its prompt or decodes, and update its slot's state; record the
    prompt tokens for the penalties. Returns `[R, 2]` (token or -1, done), logprob columns
    (or None) and the state. `mask`: the rows' structured-output bitmasks, or None; `ops`: the
    backend's (its argmax takes the greedy rows); `sampler`: the sampling parts traced. The
    one-position case of `speculative.sample_positions`."""
    out, logprobs, state, _ = speculative.sample_positions(
        state, logits, batch, flat, ints, floats, positions=1, max_len=max_len, max_logprobs=max_logprobs, mask=mask,
        ops=ops, sampler=sampler)
    return out[0], None if logprobs is None else logprobs[0], state


_STATIC = ("config", "max_len", "steps", "max_logprobs", "attention_kernel", "history_block", "ops", "sampler",
           "verify", "platform", "prompt_k")
JIT_OPTIONS = dict(static_argnames=_STATIC, donate_argnames=("cache", "state"))  # ragged_step's


@functools.partial(jax.jit, **JIT_OPTIONS)
def ragged_step(params, cache, state, flat, ints, floats, mask=None, scored=None, *, config, max_len, steps=1,
                max_logprobs=0, attention_kernel=False, history_block=None, ops=XLA, sampler=ALL, verify=0,
                platform=None, prompt_k=0):
    """`steps` steps of the batch (more than one only for decode rows, which feed themselves):
    returns `[steps, R, 2]` int32 (token or -1, done), with `[steps, R, 1 + 2 max_logprobs]`
    logprob columns when `max_logprobs`, the cache and the state (and, for a mixture of experts,
    the tokens each MoE layer sent to each expert, `[MoE layers, experts]`). `mask [R, words]`: the
    rows' structured-output bitmasks (`steps` 1); None compiles a program without one.
    `sampler`: the parts of sampling the rows need (`Sampler`; ALL serves any row).
    `verify > 0` (`steps` 1): the program of calls with speculating rows of up to `verify`
    tokens, whose result is `[verify, R, 2]`, each row's accepted tokens in order (speculative.py).
    `platform`: the one the program is traced for, its branches alone (`Ops.platform`; what it
    saves: docs/experiments.md); None: every platform's, chosen at lowering.
    `scored [2, S]` (steps 1): flat token indices and the prompt token each one's logits score
    (-1: padding); the result is then `(result, [S, 2 + 2 prompt_k] score_columns)`."""
    ops = ops.on(platform)
    scoring = scored is not None
    score_at = scored[0] if scoring else None
    TRACE_COUNTS[("step", config, ops, flat.shape[1], steps, cache.num_slots, mask is not None, sampler, verify,
                  scoring, prompt_k)] += 1
    if scoring and steps != 1:
        raise ValueError("a call that scores its prompt rows runs one step")

    def split_scores(logits):  # (the logits to sample from, the scored tokens' columns or None)
        if not scoring:
            return logits, None
        size = scored.shape[1]
        return logits[:-size], score_columns(logits[-size:], scored[1], prompt_k)

    def with_scores(result, scores):
        return result if scores is None else (result, scores)

    if verify:
        batch = resolve(state, cache.lengths, flat, ints)
        logits, cache, *expert_tokens = run_layers(params, config, cache, batch, attention_kernel=attention_kernel,
                                                   history_block=history_block, ops=ops, verify=verify,
                                                   routing=config.is_moe, score_at=score_at)
        logits, scores = split_scores(logits)
        out, logprobs, state, held = speculative.sample_positions(
            state, logits, batch, flat, ints, floats, positions=verify, max_len=max_len, max_logprobs=max_logprobs,
            mask=mask, ops=ops, sampler=sampler)
        return (with_scores(out if logprobs is None else (out, logprobs), scores),
                speculative.settle_lengths(cache, batch, held), state, *expert_tokens)

    def one_step(carry, _):
        cache, state = carry
        batch = resolve(state, cache.lengths, flat, ints)
        logits, cache, *expert_tokens = run_layers(params, config, cache, batch, attention_kernel=attention_kernel,
                                                   history_block=history_block, ops=ops, routing=config.is_moe,
                                                   score_at=score_at)
        logits, scores = split_scores(logits)
        out, logprobs, state = sample_rows(state, logits, batch, flat, ints, floats, max_len=max_len,
                                           max_logprobs=max_logprobs, mask=mask, ops=ops, sampler=sampler)
        return (cache, state), (out, logprobs, expert_tokens, scores)

    if steps == 1:  # one step needs no scan (a one-trip while loop around the whole model)
        (cache, state), out = one_step((cache, state), None)
        out = jax.tree.map(lambda a: a[None], out)
    else:
        (cache, state), out = jax.lax.scan(one_step, (cache, state), None, length=steps)
    out, logprobs, expert_tokens, scores = out
    # A mixture of experts' tokens per expert and layer, summed over the steps: a fourth result.
    return (with_scores(out if logprobs is None else (out, logprobs), None if scores is None else scores[0]), cache,
            state, *(jnp.sum(a, axis=0) for a in expert_tokens))
