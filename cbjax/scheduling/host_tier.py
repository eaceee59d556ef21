"""The KV cache's second tier, host memory: the byte accounting and the moves a round asks for.

A bounded pool (`capacity` bytes) holds two kinds of entries:
- swapped-out sequences (`preemption_mode="swap"`): a preempted request's cached positions
  and decode-state row, restored when it is readmitted instead of prefilled again;
- prefix pages (paged cache with prefix caching): a device page evicted from the prefix
  cache is copied here (least recently used first out), and a later prompt whose hash
  chain reaches it loads it back instead of prefilling it.

Swapped sequences come first: one evicts prefix pages to fit, and when the sequences already
swapped out leave no room the preemption falls back to recompute (counted). A prefix page
that finds no room is simply not kept. A prefix page loaded back leaves the tier (it lives
on the device again, registered in the device prefix cache).

Plain Python: the data itself is the runtime's (cbjax/runtime/host_kv.py). What the device
must do is appended to `ops`, in order, as `KVOp`s; the engine runs them before the round's
steps, in that order (a gather before any write that reuses the page or slot).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class KVOp:
    """One move between the device cache and host memory.

    kind: "seq_out" (gather `length` cached positions of `slot`, held in `pages` when paged,
    and the slot's state row, under `key`), "seq_in" (write `key`'s sequence into `slot` /
    `pages`), "seq_drop" (forget `key`'s sequence), "page_out" (copy device page `page` to host
    under prefix key `key`), "page_in" (write prefix key `key`'s page into device page `page`),
    "page_drop" (forget a prefix page)."""

    kind: str
    key: object
    slot: int = -1
    page: int = -1
    length: int = 0
    pages: tuple[int, ...] | None = None


@dataclasses.dataclass
class HostTierStats:
    swaps_out: int = 0
    swaps_in: int = 0
    swap_fallbacks: int = 0  # preemptions that found the pool full of swapped sequences: recomputed
    swap_bytes: int = 0  # bytes swapped out (the same come back in, unless aborted)
    pages_out: int = 0  # device prefix pages copied to host on eviction
    pages_in: int = 0  # prefix pages loaded back (host-tier hits)
    pages_dropped: int = 0  # prefix pages evicted from host memory too


class HostTier:
    def __init__(self, capacity: int, page_bytes: int, sequence_bytes: Callable[[int], int]):
        """`page_bytes`: one prefix page; `sequence_bytes(length)`: a swapped sequence of
        `length` cached positions as the runtime stores it (padded, with its state row)."""
        if capacity < page_bytes:
            raise ValueError(f"host_kv_cache_bytes={capacity} is smaller than one page of KV "
                             f"({page_bytes} bytes)")
        self.capacity = capacity
        self.page_bytes = page_bytes
        self.sequence_bytes = sequence_bytes
        self.sequences: dict[object, int] = {}  # key -> bytes
        self.prefix: collections.OrderedDict[object, None] = collections.OrderedDict()  # LRU order
        self.ops: list[KVOp] = []
        self.stats = HostTierStats()

    @property
    def used(self) -> int:
        return sum(self.sequences.values()) + len(self.prefix) * self.page_bytes

    def take_ops(self) -> list[KVOp]:
        ops, self.ops = self.ops, []
        return ops

    def _drop_prefix_until(self, nbytes: int) -> bool:
        """Evict prefix pages, least recently used first, until `nbytes` more fit."""
        if sum(self.sequences.values()) + nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            key, _ = self.prefix.popitem(last=False)
            self.ops.append(KVOp("page_drop", key))
            self.stats.pages_dropped += 1
        return True

    # ------------------------------------------------------ swapped sequences
    def swap_out(self, key: object, slot: int, length: int, pages: list[int] | None) -> bool:
        """Room for a preempted sequence's `length` cached positions; False (counted) when the
        sequences already swapped out leave none: the caller recomputes instead."""
        nbytes = self.sequence_bytes(length)
        if not self._drop_prefix_until(nbytes):
            self.stats.swap_fallbacks += 1
            return False
        self.sequences[key] = nbytes
        self.ops.append(KVOp("seq_out", key, slot=slot, length=length,
                             pages=None if pages is None else tuple(pages)))
        self.stats.swaps_out += 1
        self.stats.swap_bytes += nbytes
        return True

    def swap_in(self, key: object, slot: int, pages: list[int] | None) -> None:
        del self.sequences[key]
        self.ops.append(KVOp("seq_in", key, slot=slot, pages=None if pages is None else tuple(pages)))
        self.stats.swaps_in += 1

    def forget(self, key: object) -> None:
        """A swapped-out request ended while waiting (aborted): its bytes are freed."""
        if self.sequences.pop(key, None) is not None:
            self.ops.append(KVOp("seq_drop", key))

    # ------------------------------------------------------------ prefix pages
    def has_page(self, key: int) -> bool:
        return key in self.prefix

    def page_out(self, key: int, page: int) -> None:
        """A device page holding prefix `key` is about to be reused: keep a copy if room allows."""
        if key in self.prefix:
            self.prefix.move_to_end(key)
            return
        if self._drop_prefix_until(self.page_bytes):
            self.prefix[key] = None
            self.ops.append(KVOp("page_out", key, page=page))
            self.stats.pages_out += 1

    def claim_page(self, key: int) -> None:
        """A prompt hit `key` here: it leaves the tier now (before any page is taken for it,
        so no eviction this round can drop it); `page_in` writes it to its device page."""
        del self.prefix[key]

    def page_in(self, key: int, page: int) -> None:
        self.ops.append(KVOp("page_in", key, page=page))
        self.stats.pages_in += 1
