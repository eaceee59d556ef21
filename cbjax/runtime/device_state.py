"""What the engine's jitted steps share: the per-slot decode state on the device, the
stop test, and the compilation counters."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Per-slot decode state on the device."""

    tokens: jax.Array  # [S] int32: last sampled token, the next decode input
    active: jax.Array  # [S] bool
    num_generated: jax.Array  # [S] int32
    max_tokens: jax.Array  # [S] int32
    temperature: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32
    top_p: jax.Array  # [S] float32
    seeds: jax.Array  # [S] int32
    stop_ids: jax.Array  # [S, max_stop_tokens] int32, -1 padded

    @classmethod
    def init(cls, num_slots: int, max_stop_tokens: int) -> "SlotState":
        # Distinct buffers per field: the state is donated, and XLA refuses to donate one buffer twice.
        def zeros(dtype=jnp.int32):
            return jnp.zeros((num_slots,), dtype)

        return cls(tokens=zeros(), active=zeros(bool), num_generated=zeros(), max_tokens=zeros(),
                   temperature=zeros(jnp.float32), top_k=zeros(), top_p=jnp.ones((num_slots,), jnp.float32),
                   seeds=zeros(), stop_ids=jnp.full((num_slots, max_stop_tokens), -1, jnp.int32))

    def set_rows(self, target, *, token, done, num_generated, max_tokens, temperature, top_k, top_p, seeds,
                 stop_ids) -> "SlotState":
        """The state after row b's sample: slot `target[b]` gets its token, stays active unless
        `done`, and takes the row's sampling parameters. Rows whose target is out of range
        (`num_slots`) change nothing."""
        def put(field, value):
            return field.at[target].set(value, mode="drop")

        return SlotState(tokens=put(self.tokens, token), active=put(self.active, ~done),
                         num_generated=put(self.num_generated, num_generated),
                         max_tokens=put(self.max_tokens, max_tokens),
                         temperature=put(self.temperature, temperature), top_k=put(self.top_k, top_k),
                         top_p=put(self.top_p, top_p), seeds=put(self.seeds, seeds),
                         stop_ids=put(self.stop_ids, stop_ids))


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
