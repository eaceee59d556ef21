"""The slot-refill scheduler: plain Python over lists, no JAX, driven by an explicit clock.

Each round the caller asks `schedule(now)` for a `Plan` (prefill chunks to run, whether to
decode, and the device calls they make: which rows in which call, for how many steps; a
constrained or a verify row makes its call one step, and a decode-only round says which
slots a next decode call may be dispatched for before it is recorded), runs its calls, and hands the results
back through `update` (update.py). The decisions are its policies': which waiting requests may
start (policies.py: static, dynamic, continuous), which prompt chunks a round runs
(prefill_first, or one mixed step under a token budget); they read the
scheduler through a `SchedulerView` and return their decision, and only the scheduler
changes its state. The paged cache's page look-ahead is page_reservation.py's.
"""

from __future__ import annotations

import bisect

from cbjax.request import FinishReason, Request, RequestState
from cbjax.scheduling import forks, ordering
from cbjax.scheduling.adapter_slots import AdapterSlots
from cbjax.scheduling.block_manager import BlockManager
from cbjax.scheduling.config import SchedulerConfig
from cbjax.scheduling.host_tier import HostTier
from cbjax.scheduling.page_reservation import PageReservations
from cbjax.scheduling.plan import Call, Plan, RoundResult, Row
from cbjax.scheduling.policies import NOTHING, Admission, MixedStep, SchedulerView, admission_policy, prefill_chunks
from cbjax.scheduling.speculation import Speculator
from cbjax.scheduling.update import Outcome, update_round


class Scheduler:
    def __init__(self, config: SchedulerConfig, stop_tokens: set[int] | frozenset = frozenset(),
                 max_seq_len: int | None = None, pages: BlockManager | None = None, host: HostTier | None = None):
        self.config = config
        self.pages = pages  # the paged KV cache's allocator, or None for the slot cache
        self.host = host  # the KV cache's host tier (swapped-out requests, prefix pages), or None
        if config.preemption_mode == "swap" and host is None:
            raise ValueError("preemption_mode='swap' needs a host tier (host_kv_cache_bytes > 0)")
        reach = self.decode_reach(config)
        self.reservations = None if pages is None else PageReservations(pages, reach, max_seq_len)
        self.num_preemptions = 0
        self.tokens = TokenRecorder(stop_tokens, max_seq_len, pages)
        self.waiting: list[Request] = []  # in admission order (order_key)
        self.slots: list[Request | None] = [None] * config.num_slots
        self.draining = False
        self._admitted = 0
        self.num_decode_steps = 0
        self.forks_seen = False  # some request forks a sibling's prompt (n > 1): admission checks forks
        self.copies: list[tuple[int, int]] = []  # this round's KV copies for forks (pages or slots)
        self.preempted_slots: list[int] = []  # this round's preemptions, to deactivate on the device
        self.order_key = ordering.key_function(config)  # admission order (ordering.py)
        self.rank_preemption = ordering.preempts_for_rank(config)
        self.view = SchedulerView(self)  # what its policies read
        self.admission = admission_policy(config)
        self.speculator: Speculator | None = None  # speculative decoding's proposer and length policy
        self.adapters: AdapterSlots | None = None  # the LoRA adapter pool's slots (enable_lora)

    # ------------------------------------------------------------- queue
    def add(self, request: Request, predicted_len: int | None = None) -> None:
        """Queue a new request; `predicted_len`: the output tokens a length predictor expects."""
        if predicted_len is not None and request.predicted_len is None:
            request.predicted_len = predicted_len
        self.forks_seen |= request.fork_of is not None
        request.seq_index = self._admitted
        self._admitted += 1
        request.state = RequestState.WAITING
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        # The queue is kept in admission order, so a round never sorts it (a simulated
        # study can hold 10^5 waiting requests).
        bisect.insort(self.waiting, request, key=self.order_key)

    def drain(self, draining: bool = True) -> None:
        """No more arrivals are coming (offline generation): static may run a partial batch."""
        self.draining = draining

    def abort(self, request_id: str, now: float) -> Request:
        for i, r in enumerate(self.waiting):
            if r.request_id == request_id:
                del self.waiting[i]
                self.finish(r, FinishReason.ABORT, now)
                return r
        for r in self.slots:
            if r is not None and r.request_id == request_id:
                self.finish(r, FinishReason.ABORT, now)
                return r
        raise ValueError(f"cannot abort unknown or finished request {request_id!r}")

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def free_slots(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is None]

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def lowest_holder(self) -> Request:
        """The least important request holding a slot: the first to preempt."""
        return max(self.running, key=self.order_key)

    def decode_reach(self, config: SchedulerConfig) -> int:
        """The positions a decode call (or a speculating request's verification) writes ahead."""
        return max(config.decode_steps, 1 + config.num_speculative_tokens)

    # ---------------------------------------------------------- schedule
    def schedule(self, now: float, draft_len: int | None = None, run_ahead: bool = False) -> Plan:
        """The round's plan. `draft_len`: the tokens each decoding request may propose this round
        (speculative decoding; None: its speculator's length), counted against the mixed step's
        token budget. `run_ahead`: the executor may dispatch a decode call before it records."""
        speculator = self.speculator
        failed = fail_unreadable_adapters(self, now) if self.adapters is not None else []
        if draft_len is None:
            draft_len = speculator.length(len(self.running)) if speculator is not None else 0
        mixed = self.config.merge_mode != "prefill_first"
        step = MixedStep(self.view, draft_len) if mixed else None
        if step is not None:
            step.take_started()
        admission = self._admit(now) if step is None or step.budget > 0 else NOTHING
        self._place_admitted(admission.requests, now, step)
        prefills = step.chunks if mixed else prefill_chunks(self.view)
        if self.pages is not None:  # pages for the coming decodes, preempting when the pool runs dry
            self.reservations.grow_for_round(prefills, self.slots, self.order_key, self.lowest_holder, self.preempt)
        prefills = [c for c in prefills if c.request.slot is not None]
        decode = any(r.state == RequestState.RUNNING for r in self.running) if mixed else self._should_decode(prefills)
        # The plan takes the device work recorded while scheduling it.
        preempted, self.preempted_slots = self.preempted_slots, []
        copies, self.copies = self.copies, []
        plan = Plan(prefills, decode, wake_time=admission.wake if not prefills and not decode else None, mixed=mixed,
                    preempted_slots=preempted, copies=copies, kv_ops=self.host.take_ops() if self.host is not None else [],
                    draft_len=(step.draft_len if mixed else draft_len) if decode else 0, time=now,
                    lora_loads=self.adapters.take_loads() if self.adapters is not None else [], failed=failed)
        plan.calls, may_run_ahead = round_calls(self.slots, plan, speculator, self.config.decode_steps)
        if run_ahead and may_run_ahead:
            plan.ahead = slots_to_run_ahead(self, self.config.decode_steps, speculator)
        return plan

    def plan_in_flight(self, call: Call, now: float, run_ahead: bool = False) -> Plan:
        """The plan of a decode call dispatched ahead in an earlier round (host/device overlap),
        to record now; and whether a next one may be dispatched ahead of its record."""
        ahead = slots_to_run_ahead(self, self.config.decode_steps, self.speculator) if run_ahead else None
        return Plan([], True, calls=[call], ahead=ahead, in_flight=True, time=now)

    def _admit(self, now: float) -> Admission:
        admission = self.admission.admit(self.view, now)
        if admission.preempt:
            for r in admission.preempt:
                self.preempt(r)
            admission = self.admission.fill(self.view)
        return admission

    def _place_admitted(self, admitted, now: float, step: MixedStep | None) -> None:
        """Place what admission admitted while there is room: in the mixed step's budget and
        (paged) pages that leave this round's decode reservations covered (those of the running
        requests and the newcomer's own first decode call, the look-ahead `grow_for_round`
        takes), so an admission is never undone in its own round."""
        reserved = self.reservations.pages_to_grow(self.running) if self.pages is not None and admitted else 0
        for i, r in enumerate(admitted):
            if step is not None and not step.admits(r):
                break
            reserved = self.place(r, now, reserved)
            if reserved is None:
                self.admission.not_placed(admitted[i:])
                break
            if step is not None:
                step.take(r)

    def place(self, r: Request, now: float, reserved: int = 0) -> int | None:
        """Give a waiting request a free slot and (paged) its pages: it starts prefilling (a
        swapped-out one decodes on, its KV and state restored). Paged: returns the pages still
        reserved for decodes after its own (`PageReservations.take_newcomer`), or None, nothing
        changed, when they do not fit."""
        if self.pages is not None:
            reserved = self.reservations.take_newcomer(r, reserved, self.copies)
            if reserved is None:
                return None
        slot = self.free_slots[0]
        forked = r.fork_of is not None and not r.swapped  # n > 1: a sibling's prompt to copy (forks.py)
        if self.pages is None and forked and (shared := forks.fork_point(r)) is not None:
            self.copies.append((r.fork_of.slot, slot))  # the slot cache copies the sibling's slot
            r.num_prefilled = shared
        if self.adapters is not None:
            self.adapters.pin(r, now)
        self.slots[slot] = r
        r.slot = slot
        r.state = RequestState.PREFILLING
        if r.swapped:
            self.host.swap_in(r.request_id, slot, None if self.pages is None else self.pages.table(r.request_id))
            r.swapped, r.state, r.num_prefilled = False, RequestState.RUNNING, r.num_tokens - 1
        r.placed_at = r.num_prefilled
        r.metrics.scheduled_time = now if r.metrics.scheduled_time is None else r.metrics.scheduled_time
        self.waiting.remove(r)
        self.admission.on_placed(r)
        return reserved

    def preempt(self, r: Request) -> int:
        """Take `r`'s slot (and pages); it waits again and, when readmitted, recomputes its
        tokens, or (`preemption_mode="swap"`, a decoding request, room in the host tier) gets
        its KV and state back from host memory."""
        slot = r.slot
        if self.config.preemption_mode == "swap" and r.state == RequestState.RUNNING:
            pages = None if self.pages is None else self.pages.table(r.request_id)
            r.swapped = self.host.swap_out(r.request_id, slot, r.num_tokens - 1, pages)
            r.fork_of = None if r.swapped else r.fork_of  # swapped, it brings its own KV back
        if self.pages is not None:
            self.pages.free(r.request_id)
        self.preempted_slots.append(slot)
        self.slots[slot] = None
        r.slot, r.num_prefilled, r.state = None, 0, RequestState.WAITING
        r.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.admission.on_preempted(r)
        self._enqueue(r)
        return slot

    def _should_decode(self, prefills: list[Row]) -> bool:
        return self.admission.decodes(self.view, {c.request.request_id for c in prefills if c.is_last})

    # ----------------------------------------------------------- results
    def update(self, plan: Plan, result: RoundResult) -> Outcome:
        """The round's results into its requests (update.py)."""
        return update_round(self, plan, result)

    def finish(self, r: Request, reason: FinishReason, now: float, error: str | None = None) -> None:
        r.state = RequestState.FINISHED
        r.finish_reason = reason
        r.error = error
        r.metrics.finish_time = now
        if r.swapped:
            self.host.forget(r.request_id)
            r.swapped = False
        if self.pages is not None and r.request_id in self.pages.tables:
            self.pages.free(r.request_id)
        if r.slot is not None and self.slots[r.slot] is r:
            self.slots[r.slot] = None
        if self.speculator is not None:
            self.speculator.forget(r.request_id)
        if self.adapters is not None:
            self.adapters.release(r)
        self.admission.on_left(r)


class TokenRecorder:
    """What a sampled token does to its request: appended with its time, a cache page it filled
    offered to the prefix cache, and whether it stops the request (the scheduler finishes it)."""

    def __init__(self, stop_tokens, max_seq_len: int | None, pages: BlockManager | None):
        self.eos_tokens = frozenset(stop_tokens)
        self.max_seq_len = max_seq_len
        self.pages = pages

    def append(self, r: Request, token: int, now: float) -> FinishReason | None:
        """Append `token` to `r`'s output; returns why it stops there, or None."""
        # Once per generated token (10^7 times in a simulated study): kept lean.
        r.output_token_ids.append(token)
        num_tokens = len(r.prompt_token_ids) + len(r.output_token_ids)
        pages = self.pages
        if pages is not None and pages.enable_prefix_caching and (num_tokens - 1) % pages.page_size == 0:
            # A page filled during decode (the newest token is not in the cache yet): offer it
            # to follow-ups (prompt + answer + more).
            pages.register(r.request_id, r.prefill_token_ids, num_tokens - 1)
        metrics = r.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.append(now)
        return self.stop_reason(r, token, num_tokens)

    def stop_reason(self, r: Request, token: int, num_tokens: int) -> FinishReason | None:
        s = r.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos_tokens):
            return FinishReason.STOP
        if len(r.output_token_ids) >= s.max_tokens:
            return FinishReason.LENGTH
        if self.max_seq_len is not None and num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None


# ----------------------------------------------------------- a plan's device calls
def decode_rows(running: list[Request], draft_len: int, speculator: Speculator | None) -> list[Row]:
    """A row for each running request: a decode, or (speculating) its verification."""
    if speculator is None or not draft_len:
        return [Row.decode(r) for r in running]
    return [Row.speculating(r, p) if p else Row.decode(r)
            for r, p in zip(running, speculator.proposals(running, draft_len))]


def round_calls(slots: list[Request | None], plan: Plan, speculator: Speculator | None,
                decode_steps: int) -> tuple[list[Call], bool]:
    """The plan's calls over the requests in `slots`, and whether its decode call may have a
    next one dispatched ahead of its record."""
    running = RequestState.RUNNING
    if plan.mixed and plan.prefills:  # one step: the plan's chunks, then a decode row per running request
        live = [r for r in slots if r is not None and r.state == running]
        return [Call(plan.prefills + decode_rows(live, plan.draft_len, speculator))], False
    # prefill_first: a call of prompt rows, then one of decode rows (a mixed plan's round
    # without prompt rows too, so that it may run ahead).
    calls = [Call(plan.prefills)] if plan.prefills else []
    # A prefill whose first token is its last joins no decode (alone, one that computes
    # nothing); nor does a constrained one, whose mask needs its first token on the host: it
    # decodes from the next round on.
    starting = {c.request.request_id for c in plan.prefills
                if c.is_last and decodes_after_prefill(c.request) and c.request.grammar is None}
    live = [r for r in slots if r is not None and (r.state == running or r.request_id in starting)]
    if not plan.decode or not live:
        return calls, False
    rows = decode_rows(live, plan.draft_len, speculator)
    # A constrained row's mask follows the token before it, a verify row's end is the host's
    # to read: one step per call.
    one = any(r.grammar is not None for r in live) or any(r.verify for r in rows)
    calls.append(Call(rows, 1 if one else decode_steps))
    return calls, not plan.prefills and not one


def decodes_after_prefill(request: Request) -> bool:
    """Whether a request still has tokens to make after the one its last prefill chunk samples."""
    return request.sampling.max_tokens - len(request.output_token_ids) > 1


def slots_to_run_ahead(sched, steps: int, speculator: Speculator | None) -> list[int] | None:
    """The slots a decode call may be dispatched for before the one in flight is recorded, or
    None: not while requests wait, a holder is prefilling or constrained (its next mask needs
    this call's token on the host first), requests speculate (a proposal needs the tokens of
    the call in flight), or (paged) the next call would grow a table (the scheduler reserves,
    or preempts, first)."""
    holders = [r for r in sched.slots if r is not None]
    if sched.waiting or not holders or any(r.state != RequestState.RUNNING or r.grammar is not None
                                           for r in holders):
        return None
    if speculator is not None and speculator.length(len(holders)) > 0:
        return None
    after = [r.num_tokens + steps for r in holders]  # tokens each will have when the call in flight is recorded
    if sched.pages is not None and not all(map(sched.reservations.covers, holders, after)):
        return None
    return [r.slot for r in holders]


def fail_unreadable_adapters(sched: Scheduler, now: float) -> list[Request]:
    """Finish, with the error, the waiting requests whose LoRA adapter can no longer be read."""
    failed = sched.adapters.unreadable(sched.waiting)
    for r, message in failed:
        sched.waiting.remove(r)
        sched.finish(r, FinishReason.ERROR, now, error=message)
    return [r for r, _ in failed]
