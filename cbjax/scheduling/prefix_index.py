"""The prefix cache's index: which device page holds which prefix, by hash-chain key.

Every full page is keyed by a hash chain over its tokens (the key of page i covers
tokens [0, (i+1) * page_size)), so two prompts with a common prefix find the same
keys. A page keeps its key until the block manager hands it out again; then the key
is dropped, and with a host tier (host_tier.py) the page's contents are copied there
first, so the chain goes on in host memory past the device's hits.
"""

from __future__ import annotations

import dataclasses

from cbjax.scheduling.host_tier import HostTier


@dataclasses.dataclass
class PrefixStats:
    queries: int = 0  # full prompt pages looked up
    hits: int = 0  # found in device pages
    host_hits: int = 0  # found in the host tier (loaded back)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hits / self.queries if self.queries else 0.0


class PrefixIndex:
    def __init__(self, page_size: int, host: HostTier | None = None):
        self.page_size = page_size
        self.host = host
        self.page_key: dict[int, int] = {}  # page -> prefix key (full, cached pages)
        self.cached: dict[int, int] = {}  # prefix key -> page
        self.seq_keys: dict[str, list[int]] = {}  # sequence id -> keys of its computed full pages
        # sequence id -> the salt its chain starts from: its LoRA adapter's (`Request.prefix_salt`),
        # so no KV computed under one adapter serves another
        self.seq_salt: dict[str, int] = {}
        self.stats = PrefixStats()

    def keys(self, tokens: list[int], known: tuple[int, ...] | list[int] = (), salt: int = 0) -> list[int]:
        """Hash-chain keys of the full pages of `tokens`, extending the `known` leading ones (or
        starting from `salt`)."""
        keys = list(known)
        key = keys[-1] if keys else salt
        for i in range(len(keys), len(tokens) // self.page_size):
            key = hash((key, tuple(tokens[i * self.page_size:(i + 1) * self.page_size])))
            keys.append(key)
        return keys

    def lookup(self, tokens: list[int], salt: int = 0) -> tuple[list[int], list[int]]:
        """The cached pages a prompt can reuse, on the device and then (their keys) in the host
        tier: whole pages, and never one holding its last token, which must be computed to
        produce the first output token."""
        pages, host_keys = [], []
        for key in self.keys(tokens[:len(tokens) - 1], salt=salt):
            page = self.cached.get(key)
            if page is not None and not host_keys:
                pages.append(page)
            elif self.host is not None and self.host.has_page(key):
                host_keys.append(key)
            else:
                break
        return pages, host_keys

    def count(self, num_tokens: int, hits: int, host_hits: int) -> None:
        self.stats.queries += num_tokens // self.page_size
        self.stats.hits += hits
        self.stats.host_hits += host_hits

    def holds(self, page: int) -> bool:
        return page in self.page_key

    def bind(self, key: int, page: int) -> None:
        self.cached[key] = page
        self.page_key[page] = key

    def release(self, page: int) -> None:
        """`page` is handed out again: its key goes (to the host tier, with one)."""
        key = self.page_key.pop(page, None)
        if key is not None and self.cached.get(key) == page:
            del self.cached[key]
            if self.host is not None:
                self.host.page_out(key, page)

    def load_back(self, host_keys: list[int], take_page) -> list[int]:
        """Fresh device pages (from `take_page`) holding the host tier's pages of `host_keys`."""
        for key in host_keys:  # out of the host tier before any eviction could drop them
            self.host.claim_page(key)
        pages = []
        for key in host_keys:
            page = take_page()
            self.host.page_in(key, page)
            self.bind(key, page)
            pages.append(page)
        return pages

    def register(self, seq_id: str, table: list[int], tokens: list[int], num_computed: int) -> None:
        """Offer the sequence's full pages whose keys and values are now computed (the first
        `num_computed` of `tokens`) to later prompts. Registering only computed pages means a
        prefix hit never reads a page another prefill has yet to write."""
        known = self.seq_keys[seq_id]
        if num_computed // self.page_size <= len(known):
            return
        keys = self.keys(tokens[:num_computed], known, self.seq_salt.get(seq_id, 0))
        for i in range(len(known), len(keys)):
            if keys[i] not in self.cached and table[i] not in self.page_key:
                self.bind(keys[i], table[i])
        self.seq_keys[seq_id] = keys
