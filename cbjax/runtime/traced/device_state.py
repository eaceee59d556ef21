"""What the engine's jitted steps share: the per-slot decode state on the device, the
penalties' history, the stop test, and the compilation counters."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

# A request's sampling parameters, packed per slot in two arrays (and per row on the host, one
# copy each): int columns, then its stop ids and logit-bias ids; float columns, then the bias values.
# LORA: the request's LoRA adapter slot (0: the base model; cbjax/models/lora.py), which its
# decode rows read here.
MAX_TOKENS, TOP_K, SEED, MIN_TOKENS, LOGPROBS, LORA = range(6)
TEMPERATURE, TOP_P, PRESENCE, FREQUENCY, REPETITION, MIN_P = range(6)
NUM_INTS, NUM_FLOATS = 6, 6


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Per-slot decode state on the device: what the last step left (`tokens`, `active`,
    `num_generated`), the request's sampling parameters, and the penalties' history.

    The sampling parameters are two packed arrays, not a field each: a step that starts a
    request selects and writes each array once, where fourteen fields were fourteen small
    kernels apiece (on XLA:CPU each ran on the pool with a thread hand-off: a few percent of a
    small model's one-sequence step, docs/code_measurements.md). The properties read their columns."""

    tokens: jax.Array  # [S] int32: last sampled token, the next decode input
    active: jax.Array  # [S] bool
    num_generated: jax.Array  # [S] int32
    ints: jax.Array  # [S, NUM_INTS + max_stop_tokens + max_logit_bias] int32 (ids -1 padded)
    floats: jax.Array  # [S, NUM_FLOATS + max_logit_bias] float32
    seen: jax.Array  # [S, V] bool: token ids of the prompt (repetition penalty)
    counts: jax.Array  # [S, V] int32: occurrences in the output so far (all three penalties)

    @classmethod
    def init(cls, num_slots: int, max_stop_tokens: int, max_logit_bias: int, vocab_size: int) -> "SlotState":
        # Distinct buffers per field: the state is donated, and XLA refuses to donate one buffer twice.
        def full(value, dtype=jnp.int32, *shape):
            return jnp.full((num_slots, *shape), value, dtype)

        ints = jnp.full((num_slots, NUM_INTS + max_stop_tokens + max_logit_bias), -1, jnp.int32)
        ints = ints.at[:, [MAX_TOKENS, TOP_K, SEED, MIN_TOKENS, LORA]].set(0)
        floats = jnp.zeros((num_slots, NUM_FLOATS + max_logit_bias), jnp.float32)
        floats = floats.at[:, [TOP_P, REPETITION]].set(1)
        return cls(tokens=full(0), active=full(False, bool), num_generated=full(0), ints=ints, floats=floats,
                   seen=full(False, bool, vocab_size), counts=full(0, jnp.int32, vocab_size))

    @property
    def num_bias(self) -> int:
        return self.floats.shape[1] - NUM_FLOATS

    max_tokens = property(lambda self: self.ints[:, MAX_TOKENS])
    top_k = property(lambda self: self.ints[:, TOP_K])
    seeds = property(lambda self: self.ints[:, SEED])
    min_tokens = property(lambda self: self.ints[:, MIN_TOKENS])
    logprobs = property(lambda self: self.ints[:, LOGPROBS])  # top-k logprobs asked for, -1 = none
    stop_ids = property(lambda self: self.ints[:, NUM_INTS:self.ints.shape[1] - self.num_bias])
    bias_ids = property(lambda self: self.ints[:, self.ints.shape[1] - self.num_bias:])
    temperature = property(lambda self: self.floats[:, TEMPERATURE])
    top_p = property(lambda self: self.floats[:, TOP_P])
    min_p = property(lambda self: self.floats[:, MIN_P])  # 0 = off
    presence = property(lambda self: self.floats[:, PRESENCE])
    frequency = property(lambda self: self.floats[:, FREQUENCY])
    repetition = property(lambda self: self.floats[:, REPETITION])  # 1 = off
    bias_values = property(lambda self: self.floats[:, NUM_FLOATS:])

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
        into: XLA:CPU expands each scatter into a loop of its own kernels (a step that set eighteen
        fields spent 12% of a tiny model's step compile there). The select rewrites all S rows,
        so it is for the per-slot parameters, not the vocabulary-wide history (the step counts
        sampled tokens with `sampling.count_sampled`)."""
        num_slots = self.active.shape[0]
        hits = target[None, :] == jnp.arange(num_slots, dtype=target.dtype)[:, None]  # [S, R]
        writes, writer = hits.any(axis=1), jnp.argmax(hits, axis=1)

        def put(old, value):
            return jnp.where(writes.reshape((-1,) + (1,) * (old.ndim - 1)), value[writer], old)

        return dataclasses.replace(self, **{name: put(getattr(self, name), value) for name, value in fields.items()})


def clear_history(state: SlotState, slot) -> SlotState:
    """Slot `slot`'s row of the penalties' history cleared: a request that reads it starts there."""
    return dataclasses.replace(state, seen=state.seen.at[slot].set(False), counts=state.counts.at[slot].set(0))


def record_tokens(state: SlotState, token_slots, tokens, in_prompt) -> SlotState:
    """The penalties' history: each token of `tokens` marked seen in its slot's prompt
    (`in_prompt`) or counted as an output token (as a resumed request's prefill holds). Slot
    `num_slots` means none."""
    seen, counts = state.seen, state.counts
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
