"""The slot-refill scheduler: plain Python over lists, no JAX, driven by an explicit clock.

Each round the caller asks `schedule(now)` for a `Plan` (prefill chunks to run,
whether to decode), runs it on the engine, and hands the results back through
`on_prefill` / `on_decode`. Policies:

- `static`: wait for `batch_size` requests, run the batch until its longest member
  ends, then take the next (a partial batch only once `drain()` says no more
  requests will come).
- `dynamic`: start a batch when it is full or `window_ms` after its first request
  arrived; run it to its longest member.
- `continuous`: iteration-level; a freed slot is refilled, checked every
  `refill_interval` decode steps, with TGI's rule: while decodes run, waiting
  prefills interrupt them only when waiting/running >= `waiting_served_ratio` or
  they have waited `max_waiting_steps` decode steps.
"""

from __future__ import annotations

import bisect
import dataclasses

from cbjax import checks
from cbjax.scheduling.block_manager import BlockManager
from cbjax.request import FinishReason, Request, RequestState

POLICIES = ("static", "dynamic", "continuous")
ORDERINGS = ("fcfs", "priority")
MERGE_MODES = ("prefill_first", "fused", "chunked")


@dataclasses.dataclass
class SchedulerConfig:
    policy: str = "continuous"
    num_slots: int = 8
    batch_size: int | None = None  # static/dynamic; default num_slots
    window_ms: float = 50.0
    refill_interval: int = 1
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 20
    max_prefill_tokens: int | None = None  # prompt tokens per round; None: whole prompts
    ordering: str = "fcfs"
    length_aware: bool = False
    decode_steps: int = 1
    # How prefill meets decode: "prefill_first" (prefill calls, then a decode call), "fused"
    # (Orca: whole new prompts in the same step as the decodes) or "chunked" (Sarathi-Serve:
    # decodes first, then prompt chunks, within `max_num_batched_tokens` tokens per step).
    merge_mode: str = "prefill_first"
    max_num_batched_tokens: int | None = None

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, got {self.ordering!r}")
        self.num_slots = checks.integer("num_slots", self.num_slots, 1)
        if self.batch_size is None:
            self.batch_size = self.num_slots
        self.batch_size = checks.integer("batch_size", self.batch_size, 1, self.num_slots)
        for name in ("refill_interval", "decode_steps", "max_waiting_steps"):
            setattr(self, name, checks.integer(name, getattr(self, name), 1))
        self.window_ms = checks.real("window_ms", self.window_ms, 0.0)
        self.waiting_served_ratio = checks.real("waiting_served_ratio", self.waiting_served_ratio, 0.0)
        if self.max_prefill_tokens is not None:
            self.max_prefill_tokens = checks.integer("max_prefill_tokens (or None)", self.max_prefill_tokens, 1)
        if not isinstance(self.length_aware, bool):
            raise ValueError(f"length_aware must be a bool, got {self.length_aware!r}")
        if self.merge_mode not in MERGE_MODES:
            raise ValueError(f"merge_mode must be one of {MERGE_MODES}, got {self.merge_mode!r}")
        if self.max_num_batched_tokens is not None:
            self.max_num_batched_tokens = checks.integer("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.merge_mode != "prefill_first":
            if self.policy != "continuous":
                raise ValueError(f"merge_mode={self.merge_mode!r} is iteration-level: it needs policy='continuous'")
            if self.decode_steps != 1 or self.max_prefill_tokens is not None:
                raise ValueError(f"merge_mode={self.merge_mode!r} decodes one token per step under its token "
                                 "budget: leave decode_steps at 1 and max_prefill_tokens unset "
                                 "(max_num_batched_tokens is its budget)")
            if self.max_num_batched_tokens is None:
                raise ValueError(f"merge_mode={self.merge_mode!r} needs max_num_batched_tokens")
            if self.merge_mode == "chunked" and self.max_num_batched_tokens <= self.num_slots:
                raise ValueError(f"chunked prefill needs max_num_batched_tokens > num_slots ({self.num_slots}), "
                                 "or prefills could starve behind the decodes")


@dataclasses.dataclass
class PrefillChunk:
    """A planned piece of a prefill. `is_last` and `tokens` are fixed when it is planned:
    recording its first token grows the request's `prefill_len`, and the round still has
    to know that this chunk ended the prompt."""

    request: Request
    slot: int
    start: int  # first prompt position of the chunk
    length: int
    is_last: bool = dataclasses.field(init=False)
    tokens: list[int] = dataclasses.field(init=False)

    def __post_init__(self):
        self.is_last = self.start + self.length >= self.request.prefill_len
        self.tokens = self.request.prefill_token_ids[self.start:self.start + self.length]


@dataclasses.dataclass
class Plan:
    prefills: list[PrefillChunk]
    decode: bool
    # When there is nothing to do now: the earliest time something could change
    # without a new arrival (a dynamic window closing), else None.
    wake_time: float | None = None
    preempted_slots: list[int] = dataclasses.field(default_factory=list)  # to deactivate on the device
    mixed: bool = False  # prefills and decodes go in one mixed step

    @property
    def idle(self) -> bool:
        return not self.prefills and not self.decode


class Scheduler:
    def __init__(self, config: SchedulerConfig, stop_tokens: set[int] | frozenset = frozenset(),
                 max_seq_len: int | None = None, pages: BlockManager | None = None):
        self.config = config
        self.pages = pages  # the paged KV cache's allocator, or None for the slot cache
        self.num_preemptions = 0
        self.eos_tokens = frozenset(stop_tokens)
        self.max_seq_len = max_seq_len
        self.waiting: list[Request] = []  # in admission order (_order_key)
        self._requeued: set[str] = set()  # preempted and waiting again
        self.slots: list[Request | None] = [None] * config.num_slots
        self.batch: set[str] = set()  # static/dynamic: ids of the batch in flight
        self.steps_since_refill = 0
        self.waiting_steps = 0
        self.draining = False
        self._admitted = 0
        self.num_decode_steps = 0

    # ------------------------------------------------------------- queue
    def add(self, request: Request) -> None:
        request.seq_index = self._admitted
        self._admitted += 1
        request.state = RequestState.WAITING
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        # The queue is kept in admission order, so a round never sorts it (a simulated
        # study can hold 10^5 waiting requests).
        bisect.insort(self.waiting, request, key=self._order_key)

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

    def _order_key(self, r: Request):
        if self.config.ordering == "priority":
            return (r.priority, r.arrival_time, r.seq_index)
        return (r.arrival_time, r.seq_index)

    # ---------------------------------------------------------- schedule
    def schedule(self, now: float) -> Plan:
        if self.config.merge_mode != "prefill_first":
            return self._schedule_mixed(now)
        admitted, wake = self._admit(now)
        # Paged: admit only what leaves room for this round's decode reservations (those of
        # the running requests and the newcomer's own first decode call), the same look-ahead
        # `_reserve_decode_pages` takes, so an admission is never undone in its own round.
        reserved = self._pages_to_grow() if self.pages is not None and admitted else 0
        for i, r in enumerate(admitted):
            if self.pages is not None:
                reserved = self._take_pages(r, reserved)
                if reserved is None:
                    self.batch -= {x.request_id for x in admitted[i:] if x.state == RequestState.WAITING}
                    break
            self._place(r, now)
        prefills = self._prefill_chunks()
        preempted = self._reserve_decode_pages(prefills) if self.pages is not None else []
        prefills = [c for c in prefills if c.request.slot is not None]
        decode = self._should_decode(prefills)
        return Plan(prefills, decode, wake_time=wake if not prefills and not decode else None,
                    preempted_slots=preempted)

    def _schedule_mixed(self, now: float) -> Plan:
        """One mixed step under the token budget, stall-free as in Sarathi-Serve: every
        running decode first, then the chunks of prompts already started, then new prompts.
        "chunked" cuts prompts to what the budget leaves; "fused" takes whole prompts only
        (one beyond the budget when it is alone, so a long prompt is never shut out)."""
        cfg = self.config
        chunked = cfg.merge_mode == "chunked"
        budget = cfg.max_num_batched_tokens - sum(
            1 for r in self.slots if r is not None and r.state == RequestState.RUNNING)
        chunks: list[PrefillChunk] = []

        def take(r: Request) -> bool:
            nonlocal budget
            n = r.prefill_len - r.num_prefilled
            if chunked:
                n = min(n, budget)
            elif n > budget and (chunks or self.running != [r]):
                return False
            if n <= 0:
                return False
            chunks.append(PrefillChunk(r, r.slot, r.num_prefilled, n))
            budget -= n
            return True

        for r in sorted((r for r in self.slots if r is not None and r.state == RequestState.PREFILLING),
                        key=self._order_key):
            if not take(r):
                break
        admitted, wake = self._admit(now) if budget > 0 else ([], None)
        reserved = self._pages_to_grow() if self.pages is not None and admitted else 0
        for r in admitted:
            fits_alone = not chunks and not self.running
            if budget <= 0 or (not chunked and r.prefill_len > budget and not fits_alone):
                break
            if self.pages is not None:
                reserved = self._take_pages(r, reserved)
                if reserved is None:
                    break
            self._place(r, now)
            take(r)
        preempted = self._reserve_decode_pages(chunks) if self.pages is not None else []
        chunks = [c for c in chunks if c.request.slot is not None]
        decode = any(r.state == RequestState.RUNNING for r in self.running)
        return Plan(chunks, decode, wake_time=wake if not chunks and not decode else None,
                    preempted_slots=preempted, mixed=True)

    def _take_pages(self, r: Request, reserved: int) -> int | None:
        """Allocate a newcomer's prompt pages if they, its first decode call's growth and the
        `reserved` pages of others' coming decodes all fit; returns the new reservation, or
        None (nothing taken) when they do not."""
        first_decode = self._decode_need(r, r.prefill_len + 1)
        if not self.pages.can_allocate(r.prefill_token_ids, first_decode, reserved):
            return None
        r.num_prefilled = self.pages.allocate(r.request_id, r.prefill_token_ids)
        return reserved + self.pages.pages_needed(first_decode) - len(self.pages.table(r.request_id))

    def _place(self, r: Request, now: float) -> None:
        """Give a waiting request a free slot: it starts prefilling."""
        slot = self.free_slots[0]
        self.slots[slot] = r
        r.slot = slot
        r.state = RequestState.PREFILLING
        r.metrics.scheduled_time = now if r.metrics.scheduled_time is None else r.metrics.scheduled_time
        self.waiting.remove(r)
        self._requeued.discard(r.request_id)

    def _admit(self, now: float) -> tuple[list[Request], float | None]:
        cfg = self.config
        if not self.waiting or not self.free_slots:
            return [], None
        ordered = self.waiting  # kept sorted by _order_key
        if cfg.policy == "continuous":
            return self._admit_continuous(ordered), None
        if self.batch:  # static and dynamic never mix batches; preempted members come back
            if not self._requeued:  # only preempted members can be waiting
                return [], None
            return [r for r in ordered if r.request_id in self.batch][:len(self.free_slots)], None
        full = len(ordered) >= cfg.batch_size
        if cfg.policy == "static":
            ready = full or self.draining
            wake = None
        else:
            first = ordered[0].arrival_time if cfg.ordering == "fcfs" else min(r.arrival_time for r in ordered)
            deadline = first + cfg.window_ms / 1000.0
            ready = full or self.draining or now >= deadline
            wake = None if ready else deadline
        if not ready:
            return [], wake
        batch = self._pick_batch(ordered, min(cfg.batch_size, len(self.free_slots)))
        self.batch = {r.request_id for r in batch}
        return batch, None

    def _pick_batch(self, ordered: list[Request], size: int) -> list[Request]:
        if not self.config.length_aware:
            return ordered[:size]
        # Seed 001's length-aware batching: the head of the queue (so nobody starves)
        # plus the waiting requests whose expected length is closest to it.
        head = ordered[0]
        rest = sorted(ordered[1:], key=lambda r: (abs(r.expected_len - head.expected_len), self._order_key(r)))
        return [head] + rest[:size - 1]

    def _admit_continuous(self, ordered: list[Request]) -> list[Request]:
        cfg = self.config
        decoding = [r for r in self.slots if r is not None and r.state == RequestState.RUNNING]
        if decoding:
            if self.steps_since_refill < cfg.refill_interval:
                return []
            self.steps_since_refill = 0
            ratio_ok = len(self.waiting) >= cfg.waiting_served_ratio * len(decoding)
            if not ratio_ok and self.waiting_steps < cfg.max_waiting_steps:
                return []
        self.waiting_steps = 0
        budget = cfg.max_prefill_tokens
        if budget is not None:
            budget -= sum(r.prefill_len - r.num_prefilled for r in self.slots
                          if r is not None and r.state == RequestState.PREFILLING)
            if budget <= 0:
                return []
        admitted = ordered[:len(self.free_slots)]
        if budget is not None:
            # Admit while the round's prefill budget lasts (the last one may be chunked).
            taken = []
            for r in admitted:
                if budget <= 0:
                    break
                taken.append(r)
                budget -= r.prefill_len
            admitted = taken
        return admitted

    def _prefill_chunks(self) -> list[PrefillChunk]:
        budget = self.config.max_prefill_tokens
        chunks = []
        pending = sorted((r for r in self.slots if r is not None and r.state == RequestState.PREFILLING),
                         key=self._order_key)
        for r in pending:
            remaining = r.prefill_len - r.num_prefilled
            length = remaining if budget is None else min(remaining, budget)
            if length <= 0:
                break
            chunks.append(PrefillChunk(r, r.slot, r.num_prefilled, length))
            if budget is not None:
                budget -= length
        return chunks

    def _reserve_decode_pages(self, prefills: list[PrefillChunk]) -> list[int]:
        """Pages for the coming decode call of every decoding request, most important first.
        When the pool runs dry, preempt (recompute) the least important request holding a
        slot: lowest priority, latest arrival. Returns the freed slots."""
        finishing = {c.request.request_id for c in prefills if c.is_last}
        growing = self._growing([r for r in self.slots if r is not None and
                                 (r.state == RequestState.RUNNING or r.request_id in finishing)])
        preempted: list[int] = []
        for r in sorted(growing, key=self._order_key):
            if r.slot is None:
                continue  # preempted below for a more important request
            need = self._positions_to_grow(r)
            while not self.pages.can_grow(r.request_id, need):
                victim = max((x for x in self.slots if x is not None), key=self._order_key)
                preempted.append(self._preempt(victim))
                if victim is r:
                    break
            if r.slot is not None:
                self.pages.grow(r.request_id, need)
        return preempted

    def _decode_need(self, r: Request, num_tokens: int) -> int:
        """Cache positions a request holding `num_tokens` tokens (the last one not yet in the
        cache) writes by the end of the next decode call: one per step, but never past its
        own last write (prompt + max_tokens - 1: the final token is not written back) nor
        past max_seq_len. Capped so, it never exceeds what `add_request` checked fits."""
        need = min(num_tokens + self.config.decode_steps - 1, r.prompt_len + r.sampling.max_tokens - 1)
        return min(need, self.max_seq_len) if self.max_seq_len is not None else need

    def _positions_to_grow(self, r: Request) -> int:
        """The cache positions a request holding a slot needs for its next decode call, when
        they exceed the pages it holds; else 0."""
        done = len(r.prompt_token_ids) + len(r.output_token_ids) + (r.state != RequestState.RUNNING)
        capacity = len(self.pages.tables[r.request_id]) * self.pages.page_size
        need = self._decode_need(r, done)
        return need if need > capacity else 0

    def _growing(self, holders: list[Request]) -> list[Request]:
        """The requests among `holders` whose next decode call needs more pages. Most rounds
        only those about to cross a page boundary: the cheap test (held tokens + steps within
        the pages held) runs per slot and per round, inline."""
        running, tables, page_size = RequestState.RUNNING, self.pages.tables, self.pages.page_size
        reach = self.config.decode_steps - 1
        return [r for r in holders if len(r.prompt_token_ids) + len(r.output_token_ids) + (r.state != running)
                + reach > len(tables[r.request_id]) * page_size and self._positions_to_grow(r)]

    def _pages_to_grow(self) -> int:
        """Pages the requests holding slots will take for their next decode call."""
        pages = self.pages
        return sum(pages.pages_needed(self._positions_to_grow(r)) - len(pages.tables[r.request_id])
                   for r in self._growing([r for r in self.slots if r is not None]))

    def _preempt(self, r: Request) -> int:
        slot = r.slot
        self.pages.free(r.request_id)
        self.slots[slot] = None
        r.slot, r.num_prefilled, r.state = None, 0, RequestState.WAITING
        r.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._requeued.add(r.request_id)
        self._enqueue(r)
        return slot

    def _should_decode(self, prefills: list[PrefillChunk]) -> bool:
        finishing = {c.request.request_id for c in prefills if c.is_last}
        active = [r for r in self.slots if r is not None and
                  (r.state == RequestState.RUNNING or r.request_id in finishing)]
        if not active:
            return False
        if self.config.policy == "continuous":
            return True
        # static/dynamic: decode once every member of the batch holds its whole prompt.
        return all(r.state == RequestState.RUNNING or r.request_id in finishing
                   for r in self.slots if r is not None)

    # ----------------------------------------------------------- results
    def on_prefill(self, chunk: PrefillChunk, token: int, now: float) -> bool:
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

    def on_decode(self, tokens_per_step, now: float) -> list[Request]:
        """Record a decode call's tokens, `[steps][slots]` with -1 for idle slots.
        Returns the requests that finished."""
        finished = []
        steps = len(tokens_per_step)
        self.num_decode_steps += steps
        self.steps_since_refill += steps
        if self.waiting:
            self.waiting_steps += steps
        running = RequestState.RUNNING
        for step_tokens in tokens_per_step:
            for r, token in zip(self.slots, step_tokens):
                if token < 0 or r is None or r.state != running:
                    continue
                if self._append(r, int(token), now):
                    finished.append(r)
        return finished

    def stop_reason(self, r: Request, token: int, num_tokens: int | None = None) -> FinishReason | None:
        s = r.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos_tokens):
            return FinishReason.STOP
        if len(r.output_token_ids) >= s.max_tokens:
            return FinishReason.LENGTH
        num_tokens = r.num_tokens if num_tokens is None else num_tokens
        if self.max_seq_len is not None and num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _append(self, r: Request, token: int, now: float) -> bool:
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
        reason = self.stop_reason(r, token, num_tokens)
        if reason is None:
            return False
        self._finish(r, reason, now)
        return True

    def _finish(self, r: Request, reason: FinishReason, now: float, error: str | None = None) -> None:
        r.state = RequestState.FINISHED
        r.finish_reason = reason
        r.error = error
        r.metrics.finish_time = now
        if self.pages is not None and r.request_id in self.pages.tables:
            self.pages.free(r.request_id)
        if r.slot is not None and self.slots[r.slot] is r:
            self.slots[r.slot] = None
        self.batch.discard(r.request_id)
