"""Host-side page allocator for the paged KV cache: free list, reference counts, prefix cache.

A sequence's pages are taken as it grows (`allocate` for the prompt, `append` one
token at a time), not reserved up front, and released by `free`. With prefix
caching, every full page is keyed by a hash chain over its tokens (the key of page
i covers tokens [0, (i+1) * page_size)), so two sequences that share a prefix share
its full pages by reference count, and a later prompt with that prefix skips
prefilling them. A freed page keeps its key until it is handed out again, so a
prefix stays cached after its sequences end, as long as the page is not reused.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class PrefixStats:
    queries: int = 0  # full prompt pages looked up
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_pages: collections.deque[int] = collections.deque(range(num_pages))
        self.ref_counts = [0] * num_pages
        self.tables: dict[str, list[int]] = {}  # sequence id -> its pages, in order
        self.lengths: dict[str, int] = {}
        self.page_key: dict[int, int] = {}  # page -> prefix key (full, cached pages)
        self.cached: dict[int, int] = {}  # prefix key -> page
        self.stats = PrefixStats()

    # ------------------------------------------------------------ queries
    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def _keys(self, tokens: list[int]) -> list[int]:
        keys, key = [], 0
        for i in range(len(tokens) // self.page_size):
            key = hash((key, tuple(tokens[i * self.page_size:(i + 1) * self.page_size])))
            keys.append(key)
        return keys

    def _cached_prefix(self, tokens: list[int]) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        pages = []
        for key in self._keys(tokens):
            page = self.cached.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_allocate(self, tokens: list[int]) -> bool:
        cached = self._cached_prefix(tokens)
        fresh = self.pages_needed(len(tokens)) - len(cached)
        revived = sum(1 for p in cached if self.ref_counts[p] == 0)  # cached but free: leaves the free list
        return fresh + revived <= self.num_free

    # ------------------------------------------------------------ changes
    def _take_free(self) -> int:
        page = self.free_pages.popleft()
        key = self.page_key.pop(page, None)
        if key is not None and self.cached.get(key) == page:
            del self.cached[key]
        self.ref_counts[page] = 1
        return page

    def allocate(self, seq_id: str, tokens: list[int]) -> int:
        """Pages for a prompt; returns how many leading tokens are already in the cache
        (whole cached pages, and never the last prompt token, which must be computed to
        produce the first output token)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        if not tokens:
            raise ValueError("cannot allocate pages for an empty sequence")
        if not self.can_allocate(tokens):
            raise MemoryError(f"not enough free pages for {len(tokens)} tokens")
        cached = self._cached_prefix(tokens)
        # Keep at least one token to compute: drop a cached page that would cover them all.
        while cached and len(cached) * self.page_size >= len(tokens):
            cached.pop()
        if self.enable_prefix_caching:
            self.stats.queries += len(tokens) // self.page_size
            self.stats.hits += len(cached)
        table = []
        for page in cached:
            if self.ref_counts[page] == 0:
                self.free_pages.remove(page)
            self.ref_counts[page] += 1
            table.append(page)
        for _ in range(self.pages_needed(len(tokens)) - len(cached)):
            table.append(self._take_free())
        self.tables[seq_id] = table
        self.lengths[seq_id] = len(tokens)
        return len(cached) * self.page_size

    def register(self, seq_id: str, tokens: list[int], num_computed: int) -> None:
        """Offer the sequence's full pages whose keys and values are now computed (the first
        `num_computed` of `tokens`) to later prompts. Registering only computed pages means a
        prefix hit never reads a page another prefill has yet to write."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq_id]
        for i, key in enumerate(self._keys(tokens[:num_computed])):
            if key not in self.cached and table[i] not in self.page_key:
                self.cached[key] = table[i]
                self.page_key[table[i]] = key

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) - len(self.tables[seq_id]) <= self.num_free

    def grow(self, seq_id: str, num_tokens: int) -> None:
        """Pages for the sequence to hold `num_tokens` tokens (all or nothing)."""
        if not self.can_grow(seq_id, num_tokens):
            raise MemoryError(f"no free pages to grow {seq_id!r} to {num_tokens} tokens")
        table = self.tables[seq_id]
        while len(table) < self.pages_needed(num_tokens):
            table.append(self._take_free())
        self.lengths[seq_id] = max(self.lengths[seq_id], num_tokens)

    def can_append(self, seq_id: str) -> bool:
        return self.lengths[seq_id] % self.page_size != 0 or self.num_free > 0

    def append(self, seq_id: str) -> None:
        """Room for one more token, taking a page when the last one is full."""
        if self.lengths[seq_id] % self.page_size == 0:
            if not self.free_pages:
                raise MemoryError(f"no free page to grow {seq_id!r}")
            self.tables[seq_id].append(self._take_free())
        self.lengths[seq_id] += 1

    def free(self, seq_id: str) -> None:
        for page in self.tables.pop(seq_id):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages.append(page)
            elif self.ref_counts[page] < 0:
                raise AssertionError(f"page {page} freed twice")
        del self.lengths[seq_id]

    def table(self, seq_id: str) -> list[int]:
        return self.tables[seq_id]
