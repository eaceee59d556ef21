"""The scheduler's policies: what decides, kept apart from the bookkeeping it decides over.

Each reads the scheduler through a `SchedulerView` (a live, read-only view of its queue,
slots and knobs) and returns its decision; only the `Scheduler` changes its own state.

Admission, which waiting requests may take free slots now, one object per policy:

- `static`: wait for `batch_size` requests, run the batch until its longest member
  ends, then take the next (a partial batch only once `drain()` says no more
  requests will come).
- `dynamic`: start a batch when it is full or `window_ms` after its first request
  arrived; run it to its longest member.
- `continuous`: iteration-level; a freed slot is refilled, checked every
  `refill_interval` decode steps, with TGI's rule: while decodes run, waiting
  prefills interrupt them only when waiting/running >= `waiting_served_ratio` or
  they have waited `max_waiting_steps` decode steps. Under a ranked ordering with
  `priority_preemption`, a waiting request that outranks the least important holder
  takes its slot.

The prompt rows of a round:

- prefill_first: `prefill_chunks`, the slots' pending prompt chunks within the round's
  `max_prefill_tokens` (a step of prompt rows, then one of decode rows).
- fused / chunked: a `MixedStep`, one step under the token budget, stall-free as in
  Sarathi-Serve: every running decode first, then the chunks of prompts already started,
  then new prompts. "chunked" cuts prompts to what the budget leaves; "fused" takes whole
  prompts only (one beyond the budget when it is alone, so a long prompt is never shut out).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from typing_extensions import override

from cbjax.request import Request, RequestState
from cbjax.scheduling import forks
from cbjax.scheduling.plan import Row


class SchedulerView:
    """What a policy may read of the scheduler, live (it never writes through it)."""

    __slots__ = ("_sched",)

    def __init__(self, scheduler):
        self._sched = scheduler

    config = property(lambda self: self._sched.config)
    order_key = property(lambda self: self._sched.order_key)  # admission order (ordering.py)
    rank_preemption = property(lambda self: self._sched.rank_preemption)
    draining = property(lambda self: self._sched.draining)  # no more arrivals are coming
    num_waiting = property(lambda self: len(self._sched.waiting))
    num_free = property(lambda self: self._sched.slots.count(None))

    def startable(self) -> Sequence[Request]:
        """The waiting requests that may start now, in admission order (forks.py)."""
        sched = self._sched
        waiting = forks.startable(sched.waiting) if sched.forks_seen else sched.waiting
        return waiting if sched.adapters is None else sched.adapters.startable(waiting)

    def holders(self) -> list[Request]:
        """The requests holding a slot, in slot order."""
        return [r for r in self._sched.slots if r is not None]

    def decoding(self) -> list[Request]:
        """The holders past their prompt."""
        running = RequestState.RUNNING
        return [r for r in self._sched.slots if r is not None and r.state == running]

    def prefilling(self) -> list[Request]:
        """The holders still prefilling, most important first."""
        prefilling = RequestState.PREFILLING
        return sorted((r for r in self._sched.slots if r is not None and r.state == prefilling),
                      key=self._sched.order_key)


@dataclasses.dataclass(frozen=True)
class Admission:
    """A policy's decision: the requests to place now, in order (the scheduler stops at the
    first the cache cannot take); or, when nothing is admitted, when to look again without an
    arrival (`wake`, a dynamic batch's window); or holders to preempt first (`preempt`), after
    which the scheduler asks `fill` what to place."""

    requests: Sequence[Request] = ()
    wake: float | None = None
    preempt: Sequence[Request] = ()


NOTHING = Admission()


class AdmissionPolicy:
    def __init__(self, config):
        self.config = config

    def admit(self, view: SchedulerView, now: float) -> Admission:
        if not view.num_waiting or not (view.num_free or view.rank_preemption):
            return NOTHING
        ordered = view.startable()  # kept sorted by order_key
        if not ordered or not (view.num_free or self._outranks_a_holder(view, ordered[0])):
            return NOTHING
        return self._admit(view, ordered, now)

    def _admit(self, view: SchedulerView, ordered: Sequence[Request], now: float) -> Admission:
        raise NotImplementedError

    def fill(self, view: SchedulerView) -> Admission:
        """What to place once the holders an `Admission` named are preempted."""
        return NOTHING

    def decodes(self, view: SchedulerView, finishing: set[str]) -> bool:
        """prefill_first: whether the round decodes after its prompt rows (`finishing`: the ids
        of the requests whose prompt they end): whenever a holder is past its prompt."""
        return any(self._past_prompt(r, finishing) for r in view.holders())

    @staticmethod
    def _past_prompt(r: Request, finishing: set[str]) -> bool:
        return r.state == RequestState.RUNNING or r.request_id in finishing

    @staticmethod
    def _outranks_a_holder(view: SchedulerView, r: Request) -> bool:
        """Priority preemption: `r` outranks the least important request holding a slot."""
        holders = view.holders()
        return view.rank_preemption and bool(holders) and \
            view.order_key(r)[0] < view.order_key(max(holders, key=view.order_key))[0]

    # What the scheduler tells its policy.
    def on_decode(self, steps: int, waiting: bool) -> None:
        """A decode call of `steps` steps was recorded (`waiting`: requests were waiting)."""

    def on_placed(self, r: Request) -> None:
        """`r` took a slot."""

    def on_preempted(self, r: Request) -> None:
        """`r` lost its slot and waits again."""

    def on_left(self, r: Request) -> None:
        """`r` finished, or left this scheduler."""

    def not_placed(self, requests: Sequence[Request]) -> None:
        """Admitted requests the cache had no room for: they stay waiting."""


class BatchAdmission(AdmissionPolicy):
    """static and dynamic: one batch at a time, run to its longest member."""

    def __init__(self, config):
        super().__init__(config)
        self.batch: set[str] = set()  # ids of the batch in flight
        self.requeued: set[str] = set()  # its members preempted and waiting again

    @override
    def _admit(self, view: SchedulerView, ordered: Sequence[Request], now: float) -> Admission:
        cfg = self.config
        if self.batch:  # batches never mix; preempted members come back
            if not self.requeued:  # only preempted members can be waiting
                return NOTHING
            return Admission([r for r in ordered if r.request_id in self.batch][:view.num_free])
        full = len(ordered) >= cfg.batch_size
        wake = None
        if cfg.policy == "static":
            ready = full or view.draining
        else:
            first = ordered[0].arrival_time if cfg.ordering == "fcfs" else min(r.arrival_time for r in ordered)
            deadline = first + cfg.window_ms / 1000.0
            ready = full or view.draining or now >= deadline
            wake = None if ready else deadline
        if not ready:
            return Admission(wake=wake)
        batch = self._pick_batch(view, ordered, min(cfg.batch_size, view.num_free))
        self.batch = {r.request_id for r in batch}
        return Admission(batch)

    def _pick_batch(self, view: SchedulerView, ordered: Sequence[Request], size: int) -> list[Request]:
        if not self.config.length_aware:
            return list(ordered[:size])
        # Seed 001's length-aware batching: the head of the queue (so nobody starves)
        # plus the waiting requests whose expected length is closest to it.
        head = ordered[0]
        rest = sorted(ordered[1:], key=lambda r: (abs(r.expected_len - head.expected_len), view.order_key(r)))
        return [head] + rest[:size - 1]

    @override
    def decodes(self, view: SchedulerView, finishing: set[str]) -> bool:
        """Once every member of the batch holds its whole prompt."""
        holders = view.holders()
        return bool(holders) and all(self._past_prompt(r, finishing) for r in holders)

    @override
    def on_placed(self, r: Request) -> None:
        self.requeued.discard(r.request_id)

    @override
    def on_preempted(self, r: Request) -> None:
        self.requeued.add(r.request_id)

    @override
    def on_left(self, r: Request) -> None:
        self.batch.discard(r.request_id)
        self.requeued.discard(r.request_id)

    @override
    def not_placed(self, requests: Sequence[Request]) -> None:
        self.batch -= {r.request_id for r in requests if r.state == RequestState.WAITING}


class ContinuousAdmission(AdmissionPolicy):
    def __init__(self, config, refill_interval: int | None = None):
        """`refill_interval`: the config's unless given (0: a prefill-only instance, which never decodes)."""
        super().__init__(config)
        self.refill_interval = config.refill_interval if refill_interval is None else refill_interval
        self.steps_since_refill = 0  # decode steps since the running batch was last refilled
        self.waiting_steps = 0  # decode steps run while requests waited

    @override
    def _admit(self, view: SchedulerView, ordered: Sequence[Request], now: float) -> Admission:
        cfg = self.config
        decoding = view.decoding()
        if decoding:
            if self.steps_since_refill < self.refill_interval:
                return NOTHING
            self.steps_since_refill = 0
            ratio_ok = view.num_waiting >= cfg.waiting_served_ratio * len(decoding)
            if not ratio_ok and self.waiting_steps < cfg.max_waiting_steps:
                return NOTHING
        self.waiting_steps = 0
        victims = self._victims(view, ordered) if view.rank_preemption else []
        return Admission(preempt=victims) if victims else self.fill(view)

    @staticmethod
    def _victims(view: SchedulerView, ordered: Sequence[Request]) -> list[Request]:
        """Each waiting request, best first, that finds no free slot left takes the slot of the
        least important holder it outranks (which waits and recomputes later)."""
        key = view.order_key
        free = view.num_free
        holders = sorted(view.holders(), key=key)  # least important last
        victims = []
        for r in ordered:
            if free:
                free -= 1
            elif holders and key(r)[0] < key(holders[-1])[0]:
                victims.append(holders.pop())
            else:
                break
        return victims

    @override
    def fill(self, view: SchedulerView) -> Admission:
        """The startable requests for the free slots, while the round's prefill budget lasts
        (the last one may be chunked)."""
        ordered = view.startable()
        budget = self.config.max_prefill_tokens
        if budget is not None:
            budget -= sum(r.prefill_len - r.num_prefilled for r in view.prefilling())
            if budget <= 0:
                return NOTHING
        admitted = ordered[:view.num_free]
        if budget is None:
            return Admission(admitted)
        taken = []
        for r in admitted:
            if budget <= 0:
                break
            taken.append(r)
            budget -= 1 if r.swapped else r.prefill_len
        return Admission(taken)

    @override
    def on_decode(self, steps: int, waiting: bool) -> None:
        self.steps_since_refill += steps
        if waiting:
            self.waiting_steps += steps


def admission_policy(config, **kwargs) -> AdmissionPolicy:
    """The admission of `config.policy`."""
    return ContinuousAdmission(config, **kwargs) if config.policy == "continuous" else BatchAdmission(config)


def prefill_chunks(view: SchedulerView) -> list[Row]:
    """prefill_first: the slots' pending prompt chunks, most important first, within the
    round's `max_prefill_tokens`."""
    budget = view.config.max_prefill_tokens
    chunks = []
    for r in view.prefilling():
        remaining = r.prefill_len - r.num_prefilled
        length = remaining if budget is None else min(remaining, budget)
        if length <= 0:
            break
        chunks.append(Row.chunk(r, r.num_prefilled, length))
        if budget is not None:
            budget -= length
    return chunks


class MixedStep:
    """One mixed step's rows as they are taken: `take` a holder's next chunk, `admits` a
    newcomer before the scheduler places it."""

    def __init__(self, view: SchedulerView, draft_len: int = 0):
        """`draft_len`: tokens each decoding request may propose beside its own (speculation)."""
        cfg = view.config
        self.view = view
        self.chunked = cfg.merge_mode == "chunked"
        decoding = len(view.decoding())
        # Proposals take what the decodes leave, but never the last token: prompts always advance.
        room = (cfg.max_num_batched_tokens - 1 - decoding) // decoding if decoding else 0
        self.draft_len = max(min(draft_len, cfg.num_speculative_tokens, room), 0)
        self.budget = cfg.max_num_batched_tokens - decoding * (1 + self.draft_len)
        self.chunks: list[Row] = []

    def take_started(self) -> None:
        """The chunks of the prompts already started, most important first, while they fit."""
        for r in self.view.prefilling():
            if not self.take(r):
                break

    def admits(self, r: Request) -> bool:
        """Whether the budget leaves room for a newcomer (whole, unless chunked)."""
        fits_alone = not self.chunks and not self.view.holders()
        return self.budget > 0 and (self.chunked or r.swapped or r.prefill_len <= self.budget or fits_alone)

    def take(self, r: Request) -> bool:
        """Take `r`'s next chunk (a request swapped back in: its decode row) if it fits."""
        if r.state == RequestState.RUNNING:  # swapped back in: a decode row, no prompt
            self.budget -= 1
            return True
        n = r.prefill_len - r.num_prefilled
        if self.chunked:
            n = min(n, self.budget)
        elif n > self.budget and (self.chunks or self.view.holders() != [r]):
            return False
        if n <= 0:
            return False
        self.chunks.append(Row.chunk(r, r.num_prefilled, n))
        self.budget -= n
        return True
