"""A step's rows as the device reads them: the packed int32 columns of each row (one
host-to-device copy for every row's scalars), and `resolve`, which fills in what only the
device knows (a decode row's input token and position, whether its slot is still active)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cbjax.runtime.traced.device_state import LORA

# Packed int32 columns of one row, then the sampling parameters of a row that ends its prompt,
# packed as `SlotState.ints` and `.floats` are. VERIFY: the row is a running sequence's last
# token followed by proposed tokens, each of whose positions the step samples (speculative.py).
# ADAPTER: a prompt or verify row's LoRA slot (a decode row's is its slot's, on the device).
SLOT, START, QLEN, IS_DECODE, IS_LAST, GENERATED, PROMPT_LEN, VERIFY, ADAPTER = range(9)
HEADER = 9


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Resolved:
    """A packed batch with what only the device knows filled in (decode rows' inputs and
    positions, whether their slot is still active)."""

    inputs: jax.Array  # [N] token ids
    token_row: jax.Array  # [N] row of each token, R for padding
    token_slot: jax.Array  # [N] slot of each token (in range)
    token_pos: jax.Array  # [N] absolute position
    valid: jax.Array  # [N] bool: a real token of a row that computes
    slot: jax.Array  # [R] the rows' slots (num_slots for none)
    start: jax.Array  # [R] tokens of the sequence in the cache before the row
    q_len: jax.Array  # [R] tokens the row computes (a finished decode row: 0)
    cu_q: jax.Array  # [R + 1] where each row's tokens start in the buffer
    decode: jax.Array  # [R] bool
    is_last: jax.Array  # [R] bool: ends its prompt
    verify: jax.Array  # [R] bool: a running sequence's last token and proposed tokens (speculative.py)
    token_adapter: jax.Array  # [N] each token's LoRA slot (0: none; cbjax/models/lora.py)


def resolve(state, lengths, flat, ints) -> Resolved:
    num_rows, num_tokens = ints.shape[0], flat.shape[1]
    num_slots = lengths.shape[0]
    tokens, token_row = flat[0], flat[1]
    slot = ints[:, SLOT]
    live = jnp.minimum(slot, num_slots - 1)
    host_len = ints[:, QLEN]
    decode = (ints[:, IS_DECODE] > 0) & (host_len > 0) & (slot < num_slots)
    q_len = jnp.where(decode, state.active[live].astype(jnp.int32), host_len)
    start = jnp.where(decode, lengths[live], ints[:, START])
    cu_q = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(host_len)])
    row = jnp.minimum(token_row, num_rows - 1)
    offset = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q[row]
    valid = (token_row < num_rows) & (offset < q_len[row])
    inputs = jnp.where(decode[row], state.tokens[live[row]], tokens)
    verify = (ints[:, VERIFY] > 0) & (host_len > 0) & (slot < num_slots) & ~decode
    adapter = jnp.where(decode, state.ints[live, LORA], ints[:, ADAPTER])
    return Resolved(inputs, token_row, live[row], start[row] + offset, valid, slot, start, q_len, cu_q, decode,
                    (ints[:, IS_LAST] > 0) & (q_len > 0) & ~decode & ~verify, verify, adapter[row])
