"""The paged cache's look-ahead: how many pages each slot holder's next decode call needs,
whether a newcomer's prompt fits beside them, and growing the holders' tables before a
round (preempting, by recompute, when the pool runs dry)."""

from __future__ import annotations

from typing import Callable

from cbjax.request import Request, RequestState
from cbjax.scheduling import forks
from cbjax.scheduling.block_manager import BlockManager


class PageReservations:
    def __init__(self, pages: BlockManager, decode_steps: int, max_seq_len: int | None):
        self.pages = pages
        self.decode_steps = decode_steps
        self.max_seq_len = max_seq_len

    def decode_need(self, r: Request, num_tokens: int) -> int:
        """Cache positions a request holding `num_tokens` tokens (the last one not yet in the
        cache) writes by the end of the next decode call: one per step, but never past its
        own last write (prompt + max_tokens - 1: the final token is not written back) nor
        past max_seq_len. Capped so, it never exceeds what `add_request` checked fits."""
        need = min(num_tokens + self.decode_steps - 1, r.prompt_len + r.sampling.max_tokens - 1)
        return min(need, self.max_seq_len) if self.max_seq_len is not None else need

    def positions_to_grow(self, r: Request) -> int:
        """The cache positions a request holding a slot needs for its next decode call, when
        they exceed the pages it holds; else 0."""
        done = len(r.prompt_token_ids) + len(r.output_token_ids) + (r.state != RequestState.RUNNING)
        need = self.decode_need(r, done)
        return need if need > self._capacity(r) else 0

    def covers(self, r: Request, num_tokens: int) -> bool:
        """Whether the pages `r` holds take its next decode call once it holds `num_tokens`."""
        return self.decode_need(r, num_tokens) <= self._capacity(r)

    def take_newcomer(self, r: Request, reserved: int, copies: list[tuple[int, int]]) -> int | None:
        """A request about to be placed: its pages (a fork's by reference, its KV copies added to
        `copies`; a swapped one's fresh); as `take`."""
        if r.swapped:
            return self.take_swapped(r, reserved)
        shared = forks.fork_point(r)
        if shared is None:
            return self.take(r, reserved)
        return self.take_fork(r, shared, reserved, copies)

    def _capacity(self, r: Request) -> int:
        return len(self.pages.tables[r.request_id]) * self.pages.page_size

    def growing(self, holders: list[Request]) -> list[Request]:
        """The requests among `holders` whose next decode call needs more pages. Most rounds
        only those about to cross a page boundary: the cheap test (held tokens + steps within
        the pages held) runs per slot and per round, inline."""
        running, tables, page_size = RequestState.RUNNING, self.pages.tables, self.pages.page_size
        reach = self.decode_steps - 1
        return [r for r in holders if len(r.prompt_token_ids) + len(r.output_token_ids) + (r.state != running)
                + reach > len(tables[r.request_id]) * page_size and self.positions_to_grow(r)]

    def pages_to_grow(self, holders: list[Request]) -> int:
        """Pages the slot `holders` will take for their next decode call."""
        pages = self.pages
        return sum(pages.pages_needed(self.positions_to_grow(r)) - len(pages.tables[r.request_id])
                   for r in self.growing(holders))

    def take(self, r: Request, reserved: int) -> int | None:
        """Allocate a newcomer's prompt pages if they, its first decode call's growth and the
        `reserved` pages of others' coming decodes all fit; returns the new reservation, or
        None (nothing taken) when they do not."""
        first_decode = self.decode_need(r, r.prefill_len + 1)
        # A prompt still to be scored computes the positions it scores (cbjax/prompt_scores.py).
        reusable = r.prompt_scores.reusable if r.prompt_scores is not None else None
        if not self.pages.can_allocate(r.prefill_token_ids, first_decode, reserved, reusable=reusable,
                                       salt=r.prefix_salt):
            return None
        r.num_prefilled = self.pages.allocate(r.request_id, r.prefill_token_ids, reusable=reusable,
                                              salt=r.prefix_salt)
        return reserved + self.pages.pages_needed(first_decode) - len(self.pages.table(r.request_id))

    def take_swapped(self, r: Request, reserved: int) -> int | None:
        """As `take`, for a swapped-out request coming back: fresh pages for its cached positions
        (all but its newest token; its own KV is written there, shared prefix pages are not
        reused) and its next decode call."""
        cached = (r.prompt_token_ids + r.output_token_ids)[:r.num_tokens - 1]
        first_decode = self.decode_need(r, r.num_tokens)
        if not self.pages.can_allocate(cached, first_decode, reserved, lookup=False):
            return None
        self.pages.allocate(r.request_id, cached, lookup=False, salt=r.prefix_salt)
        self.pages.register(r.request_id, cached, len(cached))
        return reserved + self.pages.pages_needed(first_decode) - len(self.pages.table(r.request_id))

    def take_fork(self, r: Request, shared: int, reserved: int, copies: list) -> int | None:
        """As `take`, for a fork of `r.fork_of`'s first `shared` tokens: their full pages by
        reference, the partial one copied (appended to `copies` as (source, destination))."""
        first_decode = self.decode_need(r, r.prefill_len + 1)
        src = r.fork_of.request_id
        if not self.pages.can_fork(src, r.prefill_token_ids, shared, first_decode, reserved):
            return None
        copy = self.pages.fork(src, r.request_id, r.prefill_token_ids, shared)
        if copy is not None:
            copies.append(copy)
        r.num_prefilled = shared
        return reserved + self.pages.pages_needed(first_decode) - len(self.pages.table(r.request_id))

    def grow_for_round(self, prefills: list, slots: list, order_key: Callable, victim: Callable[[], Request],
                       preempt: Callable[[Request], int]) -> None:
        """Pages for the coming decode call of every request holding one of `slots` that decodes
        this round (running, or ending its prompt in `prefills`), as `grow`: when the pool runs dry,
        `preempt(victim())`, the least important holder (highest `order_key`: lowest priority,
        latest arrival under fcfs), recomputed later."""
        finishing = {c.request.request_id for c in prefills if c.is_last}
        decoding = [r for r in slots if r is not None and
                    (r.state == RequestState.RUNNING or r.request_id in finishing)]
        self.grow(decoding, order_key, victim, preempt)

    def grow(self, decoding: list[Request], order_key: Callable, victim: Callable[[], Request],
             preempt: Callable[[Request], int]) -> None:
        """Pages for the coming decode call of each `decoding` request, most important first
        (`order_key`). While the pool cannot hold one, `preempt(victim())` frees a slot's
        pages."""
        for r in sorted(self.growing(decoding), key=order_key):
            if r.slot is None:
                continue  # preempted below for a more important request
            need = self.positions_to_grow(r)
            while not self.pages.can_grow(r.request_id, need):
                chosen = victim()
                preempt(chosen)
                if chosen is r:
                    break
            if r.slot is not None:
                self.pages.grow(r.request_id, need)
