"""The slot-refill scheduler: plain Python over lists, no JAX, driven by an explicit clock.

Each round the caller asks `schedule(now)` for a `Plan` (prefill chunks to run,
whether to decode), runs it on the engine, and hands the results back through
`on_prefill` / `on_decode`. The decisions are its policies': which waiting requests may
start (policies.py: static, dynamic, continuous), which prompt chunks a round runs
(prefill_first, or one mixed step under a token budget); they read the
scheduler through a `SchedulerView` and return their decision, and only the scheduler
changes its state. The paged cache's page look-ahead is page_reservation.py's.
"""

from __future__ import annotations

import bisect

from cbjax.request import FinishReason, Request, RequestState
from cbjax.scheduling import forks, ordering
from cbjax.scheduling.block_manager import BlockManager
from cbjax.scheduling.config import SchedulerConfig
from cbjax.scheduling.host_tier import HostTier
from cbjax.scheduling.page_reservation import PageReservations
from cbjax.scheduling.plan import Plan, Row
from cbjax.scheduling.policies import NOTHING, Admission, MixedStep, SchedulerView, admission_policy, prefill_chunks


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

    # ------------------------------------------------------------- queue
    def add(self, request: Request) -> None:
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
                self._finish(r, FinishReason.ABORT, now)
                return r
        for r in self.slots:
            if r is not None and r.request_id == request_id:
                self._finish(r, FinishReason.ABORT, now)
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
    def schedule(self, now: float, draft_len: int = 0) -> Plan:
        """The round's plan. `draft_len`: the tokens each decoding request may propose this round
        (speculative decoding), counted against the mixed step's token budget."""
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
        return Plan(prefills, decode, wake_time=admission.wake if not prefills and not decode else None, mixed=mixed,
                    preempted_slots=preempted, copies=copies, kv_ops=self.host.take_ops() if self.host is not None else [],
                    draft_len=(step.draft_len if mixed else draft_len) if decode else 0)

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
    def on_prefill(self, chunk: Row, token: int, now: float) -> bool:
        """Record a prefill chunk; for the last one, the first token. True if it finished."""
        r = chunk.request
        if r.finished:
            return False
        r.num_prefilled = chunk.start + chunk.length
        if self.pages is not None:
            self.pages.register(r.request_id, r.prefill_token_ids, r.num_prefilled)
        if not chunk.is_last:
            return False
        r.state = RequestState.RUNNING
        return self._append(r, token, now)

    def on_decode(self, tokens_per_step, now: float, device_steps: int | None = None) -> list[Request]:
        """Record a decode call's tokens, `[steps][slots]` with -1 for idle slots (`device_steps`:
        the steps it ran, when fewer: a verified proposal brings several tokens from one).
        Returns the requests that finished."""
        finished = []
        steps = len(tokens_per_step) if device_steps is None else device_steps
        self.num_decode_steps += steps
        self.admission.on_decode(steps, bool(self.waiting))
        running = RequestState.RUNNING
        for step_tokens in tokens_per_step:
            for r, token in zip(self.slots, step_tokens):
                if token < 0 or r is None or r.state != running:
                    continue
                if self._append(r, int(token), now):
                    finished.append(r)
        return finished

    def _append(self, r: Request, token: int, now: float) -> bool:
        reason = self.tokens.append(r, token, now)
        if reason is not None:
            self._finish(r, reason, now)
        return reason is not None

    def _finish(self, r: Request, reason: FinishReason, now: float, error: str | None = None) -> None:
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
