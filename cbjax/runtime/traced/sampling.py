"""On-device sampling, one set of parameters per slot: the logits processors (logit bias,
min_tokens, repetition / frequency / presence penalties), then greedy, temperature, min-p, top-k,
top-p; and the log-probabilities of the raw logits.

Randomness is a function of (request seed, index of the token in the output), so a
seeded request samples the same tokens whatever batch or slot it lands in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cbjax.models.ops import XLA, Ops
from cbjax.request import ALL, Sampler


# Where a conditional's predicate is read on the host, so `skip_unless` selects.
SELECTING_PLATFORMS = ("gpu", "cuda", "rocm")


def skip_unless(pred, branch, otherwise, operand, platform: str | None = None):
    """`branch(operand)` where `pred`, else `otherwise(operand)`: a work-skipping branch on a CPU
    or TPU, both computed and selected on a GPU. XLA:GPU evaluates a conditional's predicate
    on the host (a device-to-host copy and a wait inside the step): the host can no longer
    queue the rest of the step, nor return to dispatch the next one, while the device runs,
    so every step's dispatch and launches would sit on the device's critical path.
    `platform`: the one the program is traced for (`Ops.platform`); None: both ways, chosen
    at lowering."""
    def on_device(pred, operand):
        return jax.lax.cond(pred, branch, otherwise, operand)

    def selected(pred, operand):
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), branch(operand), otherwise(operand))

    if platform is not None:
        return (selected if platform in SELECTING_PLATFORMS else on_device)(pred, operand)
    return jax.lax.platform_dependent(pred, operand, cuda=selected, rocm=selected, default=on_device)


def _sample_row(logits, temperature, top_k, top_p, min_p, seed, index):
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    # One descending sort serves both top-k (a rank cut) and top-p (a mass cut).
    neg_sorted, order = jax.lax.sort_key_val(-scaled, jnp.arange(vocab, dtype=jnp.int32))
    sorted_logits = -neg_sorted
    rank = jnp.arange(vocab)
    # min_p (vLLM's order: on the whole tempered distribution, before top-k and top-p): in
    # the sorted logits p_i >= min_p * p_0 is logit_i >= logit_0 + log(min_p).
    keep = (sorted_logits >= sorted_logits[0] + jnp.log(min_p)) | (rank == 0)
    keep &= (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    keep &= (jnp.cumsum(probs) - probs) < top_p  # the top token always survives
    # The draw happens in vocabulary order, so each token id gets its own noise: the same
    # seed picks the same token whenever the distribution is the same, even where a 1e-7
    # difference between two near-equal logits would swap their ranks.
    keep_by_id = jnp.zeros((vocab,), bool).at[order].set(keep)
    return _draw(scaled, keep_by_id, seed, index)


def _sample_row_unsorted(logits, temperature, top_k, top_p, min_p, seed, index):
    """`_sample_row` for a row without top-k or top-p: min-p alone needs no sort (a token is
    kept when its tempered logit is within log(min_p) of the largest), and draws the same token."""
    del top_k, top_p
    scaled = logits / jnp.maximum(temperature, 1e-6)
    return _draw(scaled, scaled >= jnp.max(scaled) + jnp.log(min_p), seed, index)


def _draw(scaled, keep_by_id, seed, index):
    # Gumbel-max, as jax.random.categorical does, but with the uniforms drawn from a
    # counter-based hash of (seed, index, token id): threefry's rounds made sampling a
    # fifth of every step program's compile time (docs/engine.md, "The step's figures").
    gumbel = -jnp.log(-jnp.log(_hash_uniform(seed, index, scaled.shape[-1])))
    return XLA.argmax(jnp.where(keep_by_id, scaled, -jnp.inf) + gumbel)


def _hash_uniform(seed, index, n: int) -> jax.Array:
    """`n` uniforms in (0, 1), one per token id, a pure function of (seed, index, id):
    the ids, seed and index mixed into 32 bits, then two xor-shift-multiply rounds
    (lowbias32) spread every input bit over the word; the top 24 bits make the float."""
    x = (jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
         ^ seed.astype(jnp.uint32) * jnp.uint32(0x85EBCA6B) ^ index.astype(jnp.uint32) * jnp.uint32(0xC2B2AE35))
    for multiplier in (0x7FEB352D, 0x846CA68B):
        x = (x ^ (x >> 16)) * jnp.uint32(multiplier)
    x = x ^ (x >> 16)
    return ((x >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def sample(
    logits: jax.Array,  # [S, V] float32
    temperature: jax.Array,  # [S] float32, 0 = greedy
    top_k: jax.Array,  # [S] int32, 0 = off
    top_p: jax.Array,  # [S] float32, 1 = off
    min_p: jax.Array,  # [S] float32, 0 = off
    seeds: jax.Array,  # [S] int32
    indices: jax.Array,  # [S] int32: index of the token being sampled in its output
    ops: Ops = XLA,  # whose argmax takes the greedy rows
    sorts: bool = True,  # whether a row may have top-k or top-p (`Sampler.SORT`)
) -> jax.Array:
    """Next token per row, `[S]` int32."""
    greedy = ops.argmax(logits)

    rows = (logits, temperature, top_k, top_p, min_p, seeds, indices)

    def stochastic(_):
        # The sort over the vocabulary is the expensive part (docs/engine.md, "The step's
        # figures"): only when some sampling row has top-k or top-p.
        unsorted = lambda _: jax.vmap(_sample_row_unsorted)(*rows)  # noqa: E731
        if sorts:
            needed = jnp.any((temperature > 0) & ((top_k > 0) | (top_p < 1)))
            drawn = skip_unless(needed, lambda _: jax.vmap(_sample_row)(*rows), unsorted, None, ops.platform)
        else:
            drawn = unsorted(None)
        return jnp.where(temperature > 0, drawn, greedy)

    # Skip it all when every row is greedy.
    return skip_unless(jnp.any(temperature > 0), stochastic, lambda _: greedy, None, ops.platform)


def process_logits(logits, rows, index, history=None, platform: str | None = None) -> jax.Array:
    """vLLM's order: logit bias, min_tokens (stop ids masked while `index < min_tokens`), then
    the repetition penalty over prompt and output tokens and the frequency and presence
    penalties over the output's counts. `rows`: the rows' `SlotState`; `index`: each row's
    output index; `history()`: the rows' `(seen, counts)` (default: `rows`' own), called
    inside the branch. Skipped, as one branch, when no row has any of them (`skip_unless` on
    `platform`)."""
    num_rows, vocab = logits.shape
    row = jnp.arange(num_rows)[:, None]

    def apply(logits):
        seen, counts = history() if history is not None else (rows.seen, rows.counts)
        logits = logits.at[row, jnp.where(rows.bias_ids >= 0, rows.bias_ids, vocab)].add(rows.bias_values,
                                                                                          mode="drop")
        masked = (index < rows.min_tokens)[:, None] & (rows.stop_ids >= 0)
        logits = logits.at[row, jnp.where(masked, rows.stop_ids, vocab)].set(-jnp.inf, mode="drop")
        penalty = rows.repetition[:, None]
        repeated = seen | (counts > 0)
        logits = jnp.where(repeated, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
        return (logits - rows.frequency[:, None] * counts.astype(logits.dtype)
                - rows.presence[:, None] * (counts > 0))

    return skip_unless(jnp.any(processes(rows, index)), apply, lambda x: x, logits, platform)


def processes(rows, index) -> jax.Array:
    """`[R]` bool: whether `process_logits` changes the row's logits."""
    return ((rows.repetition != 1) | (rows.presence != 0) | (rows.frequency != 0) | (index < rows.min_tokens)
            | jnp.any(rows.bias_ids >= 0, axis=-1))


def logprob_columns(logits, token, wanted, k: int, platform: str | None = None) -> jax.Array:
    """`[rows, 1 + 2k]` float32: the sampled token's log-probability under the raw logits, the
    top k log-probabilities (best first) and their token ids (exact in float32 below 2^24).
    Computed only when some row asked (`wanted >= 0`; `skip_unless` on `platform`); zeros otherwise."""
    def compute(logits):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, token[:, None], axis=-1)
        top, ids = jax.lax.top_k(logp, k)
        return jnp.concatenate([chosen, top, ids.astype(jnp.float32)], axis=-1)

    return skip_unless(jnp.any(wanted >= 0), compute,
                       lambda _: jnp.zeros((logits.shape[0], 1 + 2 * k), jnp.float32), logits, platform)


def allowed_tokens(mask, vocab: int) -> jax.Array:
    """`[R, vocab]` bool from `mask [R, ceil(vocab / 32)]` int32 (bit j of word w: token 32 w + j)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab] > 0


def sample_next(logits, rows, index, max_logprobs: int, mask=None, history=None, ops: Ops = XLA,
                sampler: Sampler = ALL):
    """The next token of each row (`[R]` int32) under its `rows` state, sampled as output
    `index`, and, when the engine computes logprobs (`max_logprobs > 0`), `logprob_columns`.
    `mask`: the structured-output bitmask (`allowed_tokens`), applied after the logits
    processors; None in the programs of steps without a constrained row. `history`: as
    `process_logits`'. `ops`: the backend's, for the greedy argmax. `sampler`: the parts
    traced at all (the rows' parameters must need no other: `Sampler`)."""
    def processed_and_sampled(logits):
        processed = (process_logits(logits, rows, index, history, ops.platform) if sampler & Sampler.PROCESS
                     else logits)
        if mask is not None:
            processed = jnp.where(allowed_tokens(mask, logits.shape[-1]), processed, -jnp.inf)
        if not sampler & Sampler.DRAW:
            return ops.argmax(processed)
        return sample(processed, rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.seeds, index, ops,
                      sorts=bool(sampler & Sampler.SORT))

    if mask is None and not sampler & (Sampler.PROCESS | Sampler.DRAW):
        token = ops.argmax(logits)
    elif mask is None:
        # Greedy rows without a logits processor (most decode steps): the argmax of the logits as
        # they are. Deciding it here, around everything, leaves no branch that passes the
        # `[R, V]` logits through unchanged: XLA:CPU copies a conditional's result.
        plain = ~jnp.any(processes(rows, index) | (rows.temperature > 0))
        token = skip_unless(plain, ops.argmax, processed_and_sampled, logits, ops.platform)
    else:
        token = processed_and_sampled(logits)
    if not max_logprobs:
        return token, None
    if not sampler & Sampler.LOGPROBS:
        return token, jnp.zeros((logits.shape[0], 1 + 2 * max_logprobs), jnp.float32)
    return token, logprob_columns(logits, token, rows.logprobs, max_logprobs, ops.platform)


def count_sampled(counts, slots, token) -> jax.Array:
    """`counts [S, V]` with each row's sampled token counted once in its slot (`slots [R]`;
    `S`: a row that sampled nothing). One element a row, where gathering and scattering
    back the rows' `[V]` counts moved the whole vocabulary each step."""
    return counts.at[slots, token].add(1, mode="drop")
