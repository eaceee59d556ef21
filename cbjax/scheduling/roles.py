"""The schedulers of a disaggregated instance (source note 002's PD separation): one that
only prefills and one that only decodes. The front (cbjax/core/disaggregation.py) moves
each request from the first to the second with its KV.

- `PrefillScheduler`: admits and prefills as any continuous scheduler, but never plans a
  decode. A request whose prompt is in the cache and has its first token stays in its
  slot, RUNNING, until the front `release`s it (its KV moved) or it finishes there.
- `DecodeScheduler`: never takes a waiting request; requests come in prefilled
  (`can_insert` / `insert`). A request preempted for pages is evicted to the front
  (`take_evicted`), which recomputes it on a prefill instance: this side never prefills.
"""

from __future__ import annotations

from typing_extensions import override

from cbjax.request import FinishReason, Request, RequestState
from cbjax.scheduling.policies import admission_policy
from cbjax.scheduling.plan import Row
from cbjax.scheduling.scheduler import Scheduler


class PrefillScheduler(Scheduler):
    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # Nothing decodes here, so the continuous policy's refill interval (counted in decode
        # steps) must not hold admission back.
        self.admission = admission_policy(config, refill_interval=0)

    @override
    def _should_decode(self, prefills: list[Row]) -> bool:
        return False

    @override
    def decode_reach(self, config) -> int:
        return 0  # pages for prompts only: nothing decodes here, the decode instance reserves its own

    def prefilled(self) -> list[Request]:
        """Requests with their first token, held for the move to a decode instance."""
        return [r for r in self.slots if r is not None and r.state == RequestState.RUNNING]

    def release(self, r: Request) -> None:
        """Let go of a prefilled request (its KV moved): its slot and pages are free again,
        the request lives on elsewhere. A waiting sample that would fork its prompt prefills
        its own now."""
        _let_go(self, r)
        for w in self.waiting:
            if w.fork_of is r:
                w.fork_of = None

    def fail(self, r: Request, message: str, now: float) -> None:
        """Finish a request with an error (its move failed), freeing what it still holds here."""
        self.finish(r, FinishReason.ERROR, now, error=message)


class DecodeScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.evicted: list[Request] = []

    @override
    def add(self, request: Request, predicted_len: int | None = None) -> None:
        raise RuntimeError("a decode instance takes prefilled requests (insert), never a waiting one")

    @override
    def _enqueue(self, request: Request) -> None:
        self.evicted.append(request)  # preempted: back to the front, to recompute on a prefill instance

    def take_evicted(self) -> list[Request]:
        evicted, self.evicted = self.evicted, []
        for r in evicted:
            self.admission.on_left(r)
        return evicted

    @staticmethod
    def cached_tokens(r: Request) -> list[int]:
        """The tokens a prefilled request holds in the cache: all but its newest."""
        return (r.prompt_token_ids + r.output_token_ids)[:r.num_tokens - 1]

    def can_insert(self, r: Request) -> bool:
        """A free slot, and (paged) pages for its cache and its first decode call while the
        running requests' next calls stay covered."""
        if not self.free_slots:
            return False
        if self.pages is None:
            return True
        reserved = self.reservations.pages_to_grow(self.running)
        return self.pages.can_allocate(self.cached_tokens(r), self.reservations.decode_need(r, r.num_tokens),
                                       reserved)

    def insert(self, r: Request) -> tuple[int, list[int] | None]:
        """Place a prefilled request (checked by `can_insert`) in a free slot, RUNNING; returns
        the slot and (paged) the pages its KV goes to."""
        slot = self.free_slots[0]
        pages = None
        if self.pages is not None:
            self.pages.allocate(r.request_id, self.cached_tokens(r))
            pages = list(self.pages.table(r.request_id))
        self.slots[slot] = r
        r.slot, r.state, r.num_prefilled = slot, RequestState.RUNNING, r.num_tokens - 1
        return slot, pages

    def release(self, r: Request) -> None:
        """Undo `insert` (the KV never arrived)."""
        _let_go(self, r)


def _let_go(sched: Scheduler, r: Request) -> None:
    if sched.pages is not None and r.request_id in sched.pages.tables:
        sched.pages.free(r.request_id)
    sched.slots[r.slot] = None
    r.slot = None
