"""What the engine's jitted steps share: the per-slot decode state on the device, the
penalties' history, the stop test, and the compilation counters."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Per-slot decode state on the device: what the last step left (`tokens`, `active`,
    `num_generated`), the request's sampling parameters, and the penalties' history."""

    tokens: jax.Array  # [S] int32: last sampled token, the next decode input
    active: jax.Array  # [S] bool
    num_generated: jax.Array  # [S] int32
    max_tokens: jax.Array  # [S] int32
    temperature: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32
    top_p: jax.Array  # [S] float32
    min_p: jax.Array  # [S] float32, 0 = off
    seeds: jax.Array  # [S] int32
    stop_ids: jax.Array  # [S, max_stop_tokens] int32, -1 padded
    min_tokens: jax.Array  # [S] int32
    presence: jax.Array  # [S] float32
    frequency: jax.Array  # [S] float32
    repetition: jax.Array  # [S] float32, 1 = off
    logprobs: jax.Array  # [S] int32: top-k logprobs asked for, -1 = none
    bias_ids: jax.Array  # [S, max_logit_bias] int32, -1 padded
    bias_values: jax.Array  # [S, max_logit_bias] float32
    seen: jax.Array  # [S, V] bool: token ids of the prompt (repetition penalty)
    counts: jax.Array  # [S, V] int32: occurrences in the output so far (all three penalties)

    @classmethod
    def init(cls, num_slots: int, max_stop_tokens: int, max_logit_bias: int, vocab_size: int) -> "SlotState":
        # Distinct buffers per field: the state is donated, and XLA refuses to donate one buffer twice.
        def full(value, dtype=jnp.int32, *shape):
            return jnp.full((num_slots, *shape), value, dtype)

        return cls(tokens=full(0), active=full(False, bool), num_generated=full(0), max_tokens=full(0),
                   temperature=full(0, jnp.float32), top_k=full(0), top_p=full(1, jnp.float32), min_p=full(0, jnp.float32),
                   seeds=full(0),
                   stop_ids=full(-1, jnp.int32, max_stop_tokens), min_tokens=full(0),
                   presence=full(0, jnp.float32), frequency=full(0, jnp.float32),
                   repetition=full(1, jnp.float32), logprobs=full(-1), bias_ids=full(-1, jnp.int32, max_logit_bias),
                   bias_values=full(0, jnp.float32, max_logit_bias), seen=full(False, bool, vocab_size),
                   counts=full(0, jnp.int32, vocab_size))

    def rows(self, slots) -> "SlotState":
        return jax.tree.map(lambda a: a[slots], self)

    def sampling_rows(self, slots) -> "SlotState":
        """`rows` without the penalties' history (`seen` and `counts` None): those are `[R, V]`
        each, read only where a penalty is on (`sampling.process_logits`)."""
        return dataclasses.replace(self, seen=None, counts=None).rows(slots)

    def set_rows(self, target, **fields) -> "SlotState":
        """Slot `target[b]` takes row b of each given field; rows whose target is out of range
        (`num_slots`) change nothing (at most one row targets a slot).

        Each slot selects its field from the row that targets it rather than being scattered
        into: XLA:CPU expands each scatter into a loop of its own kernels, and a step sets about
        eighteen fields (12% of a tiny model's step compile). The select rewrites all S rows,
        so it is for the per-slot parameters, not the vocabulary-wide history (the step counts
        sampled tokens with `sampling.count_sampled`)."""
        num_slots = self.active.shape[0]
        hits = target[None, :] == jnp.arange(num_slots, dtype=target.dtype)[:, None]  # [S, R]
        writes, writer = hits.any(axis=1), jnp.argmax(hits, axis=1)

        def put(old, value):
            return jnp.where(writes.reshape((-1,) + (1,) * (old.ndim - 1)), value[writer], old)

        return dataclasses.replace(self, **{name: put(getattr(self, name), value) for name, value in fields.items()})


def record_tokens(state: SlotState, reset_slots, token_slots, tokens, in_prompt) -> SlotState:
    """The penalties' history: rows `reset_slots` cleared (a request starts there), then each
    token of `tokens` marked seen in its slot's prompt (`in_prompt`) or counted as an output
    token (as a resumed request's prefill holds). Slot `num_slots` means none."""
    seen = state.seen.at[reset_slots].set(False, mode="drop")
    counts = state.counts.at[reset_slots].set(0, mode="drop")
    num_slots = seen.shape[0]
    seen = seen.at[jnp.where(in_prompt, token_slots, num_slots), tokens].set(True, mode="drop")
    counts = counts.at[jnp.where(in_prompt, num_slots, token_slots), tokens].add(1, mode="drop")
    return dataclasses.replace(state, seen=seen, counts=counts)


def is_done(token, stop_ids, num_generated, max_tokens, total_len, max_len):
    is_stop = jnp.any(token[..., None] == stop_ids, axis=-1)
    return is_stop | (num_generated >= max_tokens) | (total_len >= max_len)


# Traces per program, across engines: the body of a jitted function runs once per
# compilation, so counting there counts compilations (tests assert it stops growing).
TRACE_COUNTS: collections.Counter = collections.Counter()
# Every XLA compilation in the process, the engine's or not (a stray jnp op on the host
# side compiles too): what "zero compilations after warm-up" is checked against. JAX times
# a read from its persistent compilation cache under the same event, so the count means
# the same with that cache on (the test suite turns it on) or off.
BACKEND_COMPILES = [0]


def _count_backend_compile(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        BACKEND_COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_backend_compile)
