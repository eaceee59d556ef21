"""Host-side page allocator for the paged KV cache: free list, reference counts, and the
prefix cache's pages (their index is prefix_index.py).

A sequence's pages are taken as it grows (`allocate` for the prompt, `append` one
token at a time), not reserved up front, and released by `free`. With prefix
caching, two sequences that share a prefix share its full pages by reference count,
and a later prompt with that prefix skips prefilling them. A freed page keeps its
key until it is handed out again, so a prefix stays cached after its sequences end,
as long as the page is not reused.

Eviction, as in vLLM: free pages that hold no cached prefix are handed out first;
then cached ones, least recently freed first, and a sequence's pages are freed last
page first, so the tail of a prefix goes before its head (the head is what other
prompts share). Pages filled during decode are registered too, so a follow-up
prompt that repeats prompt + answer hits them.

With a host tier (host_tier.py), a cached page about to be reused is first copied to host
memory, and a prompt's hash chain goes on there past the device's hits: those pages are
loaded back into fresh device pages instead of being prefilled.
"""

from __future__ import annotations

import collections

from cbjax.scheduling.host_tier import HostTier
from cbjax.scheduling.prefix_index import PrefixIndex, PrefixStats


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False,
                 host: HostTier | None = None):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_plain: collections.deque[int] = collections.deque(range(num_pages))  # no cached prefix
        self._free_cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # eviction order
        self.ref_counts = [0] * num_pages
        self.tables: dict[str, list[int]] = {}  # sequence id -> its pages, in order
        self.lengths: dict[str, int] = {}
        self.prefix = PrefixIndex(page_size, host) if enable_prefix_caching else None

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix is not None

    @property
    def host(self) -> HostTier | None:  # prefix pages behind the device's
        return self.prefix.host if self.prefix is not None else None

    @property
    def stats(self) -> PrefixStats:
        return self.prefix.stats if self.prefix is not None else PrefixStats()

    # ------------------------------------------------------------ queries
    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def free_pages(self) -> list[int]:
        """The free pages in the order they are handed out."""
        return list(self._free_plain) + list(self._free_cached)

    def _cached_prefix(self, tokens: list[int], reusable: int | None = None,
                       salt: int = 0) -> tuple[list[int], list[int]]:
        """The cached pages `tokens` can reuse (`reusable`: within its first that many tokens;
        `salt`: computed under that LoRA adapter, `Request.prefix_salt`)."""
        if self.prefix is None:
            return [], []
        return self.prefix.lookup(tokens if reusable is None else tokens[:reusable + 1], salt)

    def can_allocate(self, tokens: list[int], num_tokens: int = 0, reserved: int = 0, lookup: bool = True,
                     reusable: int | None = None, salt: int = 0) -> bool:
        """Whether `tokens` (grown to `num_tokens` positions, if more) fit in the free pages
        while `reserved` of them stay free for others (`lookup`: reusing cached prefix pages,
        within the first `reusable` tokens when given, of the adapter `salt`)."""
        cached = self._cached_prefix(tokens, reusable, salt)[0] if lookup else []
        fresh = self.pages_needed(max(len(tokens), num_tokens)) - len(cached)
        revived = sum(1 for p in cached if self.ref_counts[p] == 0)  # cached but free: leaves the free list
        return fresh + revived + reserved <= self.num_free

    # ------------------------------------------------------------ changes
    def _take_free(self) -> int:
        if self._free_plain:
            page = self._free_plain.popleft()
        else:
            page, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
        if self.prefix is not None:
            self.prefix.release(page)
        self.ref_counts[page] = 1
        return page

    def allocate(self, seq_id: str, tokens: list[int], lookup: bool = True, reusable: int | None = None,
                 salt: int = 0) -> int:
        """Pages for a prompt; returns how many leading tokens are already in the cache
        (whole cached pages, and never the last prompt token, which must be computed to
        produce the first output token). Pages hit in the host tier are loaded back into
        fresh ones. `lookup=False`: fresh pages only (a swapped-in sequence brings its own);
        `reusable`: cached pages within its first that many tokens only (a prompt scored from there)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        if not tokens:
            raise ValueError("cannot allocate pages for an empty sequence")
        if not self.can_allocate(tokens, lookup=lookup, reusable=reusable, salt=salt):
            raise MemoryError(f"not enough free pages for {len(tokens)} tokens")
        cached, host_keys = self._cached_prefix(tokens, reusable, salt) if lookup else ([], [])
        if self.prefix is not None and lookup:
            self.prefix.count(len(tokens), len(cached), len(host_keys))
        table = []
        for page in cached:
            if self.ref_counts[page] == 0:
                del self._free_cached[page]
            self.ref_counts[page] += 1
            table.append(page)
        if self.prefix is not None:
            table += self.prefix.load_back(host_keys, self._take_free)
            self.prefix.seq_keys[seq_id] = [self.prefix.page_key[p] for p in table]
            self.prefix.seq_salt[seq_id] = salt
        for _ in range(self.pages_needed(len(tokens)) - len(table)):
            table.append(self._take_free())
        self.tables[seq_id] = table
        self.lengths[seq_id] = len(tokens)
        return (len(cached) + len(host_keys)) * self.page_size

    def _fork_layout(self, src_id: str, shared: int) -> tuple[list[int], int]:
        """The pages a fork takes by reference (the full pages of the first `shared` tokens) and
        the number of tokens of a partial page past them, which it copies."""
        full = shared // self.page_size
        return self.tables[src_id][:full], shared - full * self.page_size

    def can_fork(self, src_id: str, tokens: list[int], shared: int, num_tokens: int = 0, reserved: int = 0) -> bool:
        """Whether a fork of `src_id`'s first `shared` tokens, holding `tokens` (grown to
        `num_tokens`), fits in the free pages while `reserved` of them stay free."""
        by_reference, _ = self._fork_layout(src_id, shared)
        return self.pages_needed(max(len(tokens), num_tokens)) - len(by_reference) + reserved <= self.num_free

    def fork(self, src_id: str, seq_id: str, tokens: list[int], shared: int) -> tuple[int, int] | None:
        """Pages for `seq_id`, whose first `shared` tokens are `src_id`'s (n > 1 samples of one
        prompt): the full pages among them are `src_id`'s, by reference count; the page holding
        the rest is a fresh one, returned as (source page, fresh page) for the device to copy
        before either writes it (copy on write), or None when there is no partial page."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        if not self.can_fork(src_id, tokens, shared):
            raise MemoryError(f"not enough free pages to fork {len(tokens)} tokens")
        by_reference, partial = self._fork_layout(src_id, shared)
        for page in by_reference:
            self.ref_counts[page] += 1
        table = list(by_reference)
        copy = (self.tables[src_id][len(table)], None) if partial else None
        for _ in range(self.pages_needed(len(tokens)) - len(table)):
            table.append(self._take_free())
        if copy is not None:
            copy = (copy[0], table[len(by_reference)])
        self.tables[seq_id] = table
        self.lengths[seq_id] = len(tokens)
        if self.prefix is not None:
            salt = self.prefix.seq_salt[seq_id] = self.prefix.seq_salt.get(src_id, 0)
            self.prefix.seq_keys[seq_id] = self.prefix.keys(tokens[:len(by_reference) * self.page_size], salt=salt)
        return copy

    def register(self, seq_id: str, tokens: list[int], num_computed: int) -> None:
        """Offer the sequence's computed full pages to later prompts (`PrefixIndex.register`)."""
        if self.prefix is not None:
            self.prefix.register(seq_id, self.tables[seq_id], tokens, num_computed)

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
            if not self.num_free:
                raise MemoryError(f"no free page to grow {seq_id!r}")
            self.tables[seq_id].append(self._take_free())
        self.lengths[seq_id] += 1

    def free(self, seq_id: str) -> None:
        for page in reversed(self.tables.pop(seq_id)):  # last page first: evicted before the head
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if self.prefix is not None and self.prefix.holds(page):
                    self._free_cached[page] = None
                else:
                    self._free_plain.append(page)
            elif self.ref_counts[page] < 0:
                raise AssertionError(f"page {page} freed twice")
        del self.lengths[seq_id]
        if self.prefix is not None:
            self.prefix.seq_keys.pop(seq_id, None)
            self.prefix.seq_salt.pop(seq_id, None)

    def table(self, seq_id: str) -> list[int]:
        return self.tables[seq_id]
