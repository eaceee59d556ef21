"""Admission: which waiting requests may take free slots now, by batching policy.

- `static`: wait for `batch_size` requests, run the batch until its longest member
  ends, then take the next (a partial batch only once `drain()` says no more
  requests will come).
- `dynamic`: start a batch when it is full or `window_ms` after its first request
  arrived; run it to its longest member.
- `continuous`: iteration-level; a freed slot is refilled, checked every
  `refill_interval` decode steps, with TGI's rule: while decodes run, waiting
  prefills interrupt them only when waiting/running >= `waiting_served_ratio` or
  they have waited `max_waiting_steps` decode steps.

A continuous policy in a mixed merge mode plans each round as one step under a token
budget (`schedule_mixed`).

Functions of the scheduler's state (its queue, slots and counters), kept apart from its
bookkeeping so each policy reads in one place.
"""

from __future__ import annotations

from cbjax.request import Request, RequestState
from cbjax.scheduling.plan import Plan, Row


def prefill_chunks(sched) -> list[Row]:
    """prefill_first: the slots' pending prompt chunks, most important first, within the
    round's `max_prefill_tokens`."""
    budget = sched.config.max_prefill_tokens
    chunks = []
    pending = sorted((r for r in sched.slots if r is not None and r.state == RequestState.PREFILLING),
                     key=sched.order_key)
    for r in pending:
        remaining = r.prefill_len - r.num_prefilled
        length = remaining if budget is None else min(remaining, budget)
        if length <= 0:
            break
        chunks.append(Row.chunk(r, r.num_prefilled, length))
        if budget is not None:
            budget -= length
    return chunks


def admit(sched, now: float) -> tuple[list[Request], float | None]:
    cfg = sched.config
    if not sched.waiting or not (sched.free_slots or sched.rank_preemption):
        return [], None
    ordered = sched.startable()  # kept sorted by order_key
    if not ordered or not (sched.free_slots or can_preempt_for(sched, ordered[0])):
        return [], None
    if cfg.policy == "continuous":
        return _admit_continuous(sched, ordered), None
    if sched.batch:  # static and dynamic never mix batches; preempted members come back
        if not sched._requeued:  # only preempted members can be waiting
            return [], None
        return [r for r in ordered if r.request_id in sched.batch][:len(sched.free_slots)], None
    full = len(ordered) >= cfg.batch_size
    if cfg.policy == "static":
        ready = full or sched.draining
        wake = None
    else:
        first = ordered[0].arrival_time if cfg.ordering == "fcfs" else min(r.arrival_time for r in ordered)
        deadline = first + cfg.window_ms / 1000.0
        ready = full or sched.draining or now >= deadline
        wake = None if ready else deadline
    if not ready:
        return [], wake
    batch = _pick_batch(sched, ordered, min(cfg.batch_size, len(sched.free_slots)))
    sched.batch = {r.request_id for r in batch}
    return batch, None


def _pick_batch(sched, ordered: list[Request], size: int) -> list[Request]:
    if not sched.config.length_aware:
        return ordered[:size]
    # Seed 001's length-aware batching: the head of the queue (so nobody starves)
    # plus the waiting requests whose expected length is closest to it.
    head = ordered[0]
    rest = sorted(ordered[1:], key=lambda r: (abs(r.expected_len - head.expected_len), sched.order_key(r)))
    return [head] + rest[:size - 1]


def _admit_continuous(sched, ordered: list[Request]) -> list[Request]:
    cfg = sched.config
    decoding = [r for r in sched.slots if r is not None and r.state == RequestState.RUNNING]
    if decoding:
        if sched.steps_since_refill < cfg.refill_interval:
            return []
        sched.steps_since_refill = 0
        ratio_ok = len(sched.waiting) >= cfg.waiting_served_ratio * len(decoding)
        if not ratio_ok and sched.waiting_steps < cfg.max_waiting_steps:
            return []
    sched.waiting_steps = 0
    if sched.rank_preemption:
        preempt_for_rank(sched, ordered)
        ordered = sched.startable()
    budget = cfg.max_prefill_tokens
    if budget is not None:
        budget -= sum(r.prefill_len - r.num_prefilled for r in sched.slots
                      if r is not None and r.state == RequestState.PREFILLING)
        if budget <= 0:
            return []
    admitted = ordered[:len(sched.free_slots)]
    if budget is not None:
        # Admit while the round's prefill budget lasts (the last one may be chunked).
        taken = []
        for r in admitted:
            if budget <= 0:
                break
            taken.append(r)
            budget -= 1 if r.swapped else r.prefill_len
        admitted = taken
    return admitted


def can_preempt_for(sched, r: Request) -> bool:
    """Priority preemption: `r` outranks the least important request holding a slot."""
    return (sched.rank_preemption and bool(sched.running)
            and sched.order_key(r)[0] < sched.order_key(sched.lowest_holder())[0])


def preempt_for_rank(sched, ordered: list[Request]) -> None:
    """Each waiting request, best first, that finds no free slot left takes the slot of the
    least important holder it outranks (which waits and recomputes later)."""
    free = len(sched.free_slots)
    for r in list(ordered):  # preempting re-queues into `ordered` itself
        if free:
            free -= 1
        elif can_preempt_for(sched, r):
            sched.preempt(sched.lowest_holder())
        else:
            break


def schedule_mixed(sched, now: float) -> Plan:
    """One mixed step under the token budget, stall-free as in Sarathi-Serve: every
    running decode first, then the chunks of prompts already started, then new prompts.
    "chunked" cuts prompts to what the budget leaves; "fused" takes whole prompts only
    (one beyond the budget when it is alone, so a long prompt is never shut out)."""
    cfg = sched.config
    chunked = cfg.merge_mode == "chunked"
    budget = cfg.max_num_batched_tokens - sum(
        1 for r in sched.slots if r is not None and r.state == RequestState.RUNNING)
    chunks: list[Row] = []

    def take(r: Request) -> bool:
        nonlocal budget
        if r.state == RequestState.RUNNING:  # swapped back in: a decode row, no prompt
            budget -= 1
            return True
        n = r.prefill_len - r.num_prefilled
        if chunked:
            n = min(n, budget)
        elif n > budget and (chunks or sched.running != [r]):
            return False
        if n <= 0:
            return False
        chunks.append(Row.chunk(r, r.num_prefilled, n))
        budget -= n
        return True

    for r in sorted((r for r in sched.slots if r is not None and r.state == RequestState.PREFILLING),
                    key=sched.order_key):
        if not take(r):
            break
    admitted, wake = admit(sched, now) if budget > 0 else ([], None)
    reserved = sched.reservations.pages_to_grow(sched.running) if sched.pages is not None and admitted else 0
    for r in admitted:
        fits_alone = not chunks and not sched.running
        if budget <= 0 or (not chunked and not r.swapped and r.prefill_len > budget and not fits_alone):
            break
        if sched.pages is not None:
            reserved = sched.take_pages(r, reserved)
            if reserved is None:
                break
        sched.place(r, now)
        take(r)
    if sched.pages is not None:
        sched.reserve_decode_pages(chunks)
    chunks = [c for c in chunks if c.request.slot is not None]
    decode = any(r.state == RequestState.RUNNING for r in sched.running)
    return sched.plan(chunks, decode, wake, mixed=True)
