"""One sequence's KV and decode state out of one engine and into another: the cache
interface prefill/decode disaggregation moves requests through (as jax-llm-examples'
`get_sequence` / `insert_sequences`).

`get_sequence` gathers a slot's (or its pages') first `length` positions per layer,
`[kv_heads, length, head_dim]`, with the slot's decode-state row; `move` puts them at
another engine's shardings with `jax.device_put` (within a process, device group to
device group; a tensor-parallel group's shards go shard to shard when both split the
KV heads, else XLA regathers them); `insert_sequence` writes them into a slot (or
pages) there. Either side may be a slot or a paged cache. Lengths are padded to a
power of two (at least one page), so the programs stay few.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from cbjax.request import ALL
from cbjax.runtime.scale import sharding
from cbjax.runtime.traced.device_state import TRACE_COUNTS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SequenceKV:
    k: tuple  # per layer: [kv_heads, padded length, head_dim]
    v: tuple
    state: object  # SlotState with one row
    length: int = dataclasses.field(metadata=dict(static=True))  # valid positions

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))


def padded_length(length: int, max_len: int, page_size: int = 1) -> int:
    """The transfer length of a `length`-token sequence: a power of two of at least one page,
    rounded up to whole pages, and at most `max_len`."""
    n = max(1 << max(length - 1, 0).bit_length(), page_size, 16)
    return min(-(-n // page_size) * page_size, max_len)


def _pages_for(table: list[int], padded: int, page_size: int, fill: int) -> np.ndarray:
    out = np.full(-(-padded // page_size), fill, np.int32)
    out[:min(len(table), len(out))] = table[:len(out)]
    return out


@functools.partial(jax.jit, static_argnames=("padded",))
def _gather(cache, state, slot, pages, *, padded):
    TRACE_COUNTS[("get_sequence", type(cache).__name__, padded)] += 1

    def take(layer):
        return cache.sequence_out(layer, slot, pages, padded)

    return tuple(map(take, cache.k)), tuple(map(take, cache.v)), state.rows(slot[None])


@functools.partial(jax.jit, donate_argnames=("cache", "state"))
def _scatter(cache, state, k, v, row, slot, pages, length):
    padded = k[0].shape[1]
    TRACE_COUNTS[("insert_sequence", type(cache).__name__, padded)] += 1

    def put(layer, new):
        return cache.sequence_in(layer, new, slot, pages)

    cache = dataclasses.replace(cache, k=tuple(map(put, cache.k, k)), v=tuple(map(put, cache.v, v)),
                                lengths=cache.lengths.at[slot].set(length))
    state = jax.tree.map(lambda field, new: field.at[slot].set(new[0]), state, row)
    return cache, state


def get_sequence(engine, slot: int, length: int, pages: list[int] | None, padded: int) -> SequenceKV:
    """Slot `slot`'s first `length` cached positions (paged: held in `pages`) and state row."""
    page_size = engine.cache.transfer_unit(padded)
    table = _pages_for(pages or [], -(-padded // page_size) * page_size, page_size, 0)
    k, v, row = _gather(engine.cache, engine.state, engine.put(np.int32(slot)), engine.put(table),
                        padded=padded)
    return SequenceKV(k, v, row, length)


def move(seq: SequenceKV, engine) -> SequenceKV:
    """`seq` at `engine`'s shardings: its KV split over KV heads as its cache is, the state
    row replicated; on one device when the engine has no mesh."""
    if engine.mesh is None:
        device = jax.tree.leaves(engine.state)[0].devices().pop()
        return jax.device_put(seq, device)
    config = engine.model.config
    kv = sharding.kv_sharding(config, engine.mesh, 0, 3)
    rep = sharding.replicated(engine.mesh)
    return SequenceKV(jax.device_put(seq.k, kv), jax.device_put(seq.v, kv), jax.device_put(seq.state, rep),
                      seq.length)


def insert_sequence(engine, seq: SequenceKV, slot: int, pages: list[int] | None, need: int = ALL) -> None:
    """Write `seq` (already at `engine`'s shardings) into slot `slot` (paged: into `pages`);
    `need`: the sampling its request needs (`SamplerVariants.of_slot`), when the caller kept it."""
    padded = seq.k[0].shape[1]
    cache = engine.cache
    page_size, fill = cache.transfer_unit(padded), cache.no_page
    table = _pages_for(pages or [], padded, page_size, fill)
    if cache.paged:
        table[-(-seq.length // page_size):] = fill  # only the pages holding the sequence are written
    engine.cache, engine.state = _scatter(engine.cache, engine.state, seq.k, seq.v, seq.state,
                                          engine.put(np.int32(slot)), engine.put(table),
                                          engine.put(np.int32(seq.length)))
    engine.samplers.slot_replaced(slot, need)
