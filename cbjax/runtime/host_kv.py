"""The host tier's data: swapped-out sequences and prefix pages in host memory, and the
device programs that move them (the accounting and the decisions are
cbjax/scheduling/host_tier.py's; this runs its `KVOp`s in order).

A swapped-out sequence is gathered as a disaggregated move's is (kv_transfer.get_sequence:
its cached positions, padded to a power of two, and its decode-state row) and sent to host
memory with `jax.device_put` to the `pinned_host` memory kind where the backend has one
besides its device memory (GPU, TPU): the copy is queued behind the gather and overlaps the
round's step, and nothing waits for it until the sequence comes back. On a CPU the device
memory is host memory already: the gathered arrays are kept as they are. Prefix pages are
gathered a batch per round, copied to numpy once (a page each, so each entry owns its
bytes) and loaded back a batch per round.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from cbjax.runtime import kv_transfer

from cbjax.runtime.scale import sharding
from cbjax.runtime.traced.device_state import TRACE_COUNTS


def bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@jax.jit
def _gather_pages(cache, pages):
    TRACE_COUNTS[("gather_pages", pages.shape[0])] += 1
    take = lambda layer: jax.tree.map(lambda a: a[:, pages], layer)  # noqa: E731 (8-bit layers: values and scales)
    return tuple(map(take, cache.k)), tuple(map(take, cache.v))


@functools.partial(jax.jit, donate_argnames="cache")
def _scatter_pages(cache, k, v, pages):
    TRACE_COUNTS[("scatter_pages", pages.shape[0])] += 1

    def put(layer, new):
        return jax.tree.map(lambda a, n: a.at[:, pages].set(n.astype(a.dtype), mode="drop"), layer, new)

    return dataclasses.replace(cache, k=tuple(map(put, cache.k, k)), v=tuple(map(put, cache.v, v)))


def _host_memory(x: jax.Array):
    """`x`'s sharding in pinned host memory, or None where the backend keeps none apart."""
    device = next(iter(x.devices()))
    if x.sharding.memory_kind in (None, "pinned_host", "unpinned_host") or device.platform == "cpu":
        return None
    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        return None
    return x.sharding.with_memory_kind("pinned_host")


def swap_length(engine, length: int) -> int:
    """The positions a swapped sequence of `length` cached tokens moves (`kv_transfer`'s padding,
    in whole pages of a paged cache)."""
    return kv_transfer.padded_length(length, engine.max_len, engine.cache.page_size if engine.cache.paged else 1)


class HostKV:
    def __init__(self):
        self.sequences: dict[object, kv_transfer.SequenceKV] = {}
        self._needs: dict[object, int] = {}  # key -> the sampling its request needs (SamplerVariants.of_slot)
        self.pages: dict[int, tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]] = {}  # key -> (k, v)

    @property
    def stored_bytes(self) -> int:
        pages = sum(a.nbytes for entry in self.pages.values() for a in jax.tree.leaves(entry))
        return pages + sum(s.num_bytes for s in self.sequences.values())

    def apply(self, engine, ops: list) -> None:
        """Run the round's moves in order; consecutive page moves of one kind go as one batch."""
        i = 0
        while i < len(ops):
            j = i + 1
            if ops[i].kind in ("page_out", "page_in"):
                while j < len(ops) and ops[j].kind == ops[i].kind:
                    j += 1
            getattr(self, "_" + ops[i].kind)(engine, ops[i:j])
            i = j

    def warmup(self, engine, pages: bool, swap: bool) -> int:
        """Compile the moves' programs before any request (a swap or a page batch met first mid-run
        would compile then): the page gather and scatter at every batch bucket, the sequence
        gather and insert at every transfer length. Leaves the cache and state as it found them
        (empty: the engine is reset)."""
        count = 0
        if pages and engine.cache.paged:
            for n in sorted({bucket(k) for k in range(1, engine.config.num_pages + 1)}):
                table = np.full(n, engine.cache.no_page, np.int32)
                k, v = _gather_pages(engine.cache, engine.put(np.zeros(n, np.int32)))
                engine.cache = _scatter_pages(engine.cache, k, v, engine.put(table))
                count += 2
        if swap:
            unit = engine.cache.page_size if engine.cache.paged else 1
            for padded in sorted({swap_length(engine, n) for n in range(1, engine.max_len)}):
                seq = kv_transfer.get_sequence(engine, 0, padded, [0] * (-(-padded // unit)), padded)
                kv_transfer.insert_sequence(engine, seq, 0, [])
                count += 2
        engine.reset()
        return count

    # ------------------------------------------------------------ sequences
    def _seq_out(self, engine, ops) -> None:
        (op,) = ops
        padded = swap_length(engine, op.length)
        seq = kv_transfer.get_sequence(engine, op.slot, op.length, op.pages and list(op.pages), padded)
        host = _host_memory(jax.tree.leaves(seq.k)[0])
        if host is not None:
            seq = jax.device_put(seq, jax.tree.map(lambda _: host, seq))  # queued behind the gather
        self.sequences[op.key] = seq
        self._needs[op.key] = engine.samplers.of_slot(op.slot)

    def _seq_in(self, engine, ops) -> None:
        (op,) = ops
        seq = self.sequences.pop(op.key)
        if engine.mesh is not None:
            seq = kv_transfer.move(seq, engine)
        elif jax.tree.leaves(seq.k)[0].sharding.memory_kind == "pinned_host":
            seq = jax.device_put(seq, jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), seq))
        # Its slot was deactivated when it was preempted (before the gather): it decodes on.
        seq = dataclasses.replace(seq, state=dataclasses.replace(seq.state, active=np.ones((1,), bool)))
        kv_transfer.insert_sequence(engine, seq, op.slot, op.pages and list(op.pages), self._needs.pop(op.key))

    def _seq_drop(self, engine, ops) -> None:
        del self.sequences[ops[0].key]
        del self._needs[ops[0].key]

    # ---------------------------------------------------------- prefix pages
    def _page_out(self, engine, ops) -> None:
        n = len(ops)
        pages = np.full(bucket(n), 0, np.int32)
        pages[:n] = [op.page for op in ops]
        k, v = jax.device_get(_gather_pages(engine.cache, engine.put(pages)))
        for i, op in enumerate(ops):
            self.pages[op.key] = jax.tree.map(lambda layer: np.ascontiguousarray(layer[:, i]), (k, v))

    def _page_in(self, engine, ops) -> None:
        n = len(ops)
        pages = np.full(bucket(n), engine.cache.no_page, np.int32)
        pages[:n] = [op.page for op in ops]
        entries = [self.pages.pop(op.key) for op in ops]
        entries += [entries[0]] * (bucket(n) - n)  # padding rows, dropped by the scatter

        k, v = jax.tree.map(lambda *page: np.stack(page, axis=1), *entries)
        if engine.mesh is not None:
            kv = sharding.kv_sharding(engine.model.config, engine.mesh, 0, 4)
            k, v = jax.device_put(k, kv), jax.device_put(v, kv)
        engine.cache = _scatter_pages(engine.cache, k, v, engine.put(pages))

    def _page_drop(self, engine, ops) -> None:
        del self.pages[ops[0].key]
