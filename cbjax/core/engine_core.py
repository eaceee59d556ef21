"""The engine core: one scheduling round between the front door and the scheduler/engine.

A round asks the scheduler for a `Plan`, deactivates the slots it preempted, hands the
engine the paged block tables, runs the plan's rows through the engine's one step (prompt
rows and then decode rows, or both in one step), copies the results to the host once, and
records them with the scheduler in one place (`_record`), whatever the round's kind. The
front door (`LLM`) only takes requests in and hands outputs out; the server loop, the
replicas front and the simulator's profiler use this class's public hooks (`load`, `idle`,
`wake_time`, `run_round`, `engine_swapped`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import jax
import numpy as np

from cbjax.core.recording import record_round
from cbjax.core.step_stats import Load, StepStats
from cbjax.request import FinishReason, Request, RequestState, SamplingParams
from cbjax.runtime.step import to_host
from cbjax.scheduling import BlockManager, Plan, Row, Scheduler
from cbjax.scheduling.speculation import Speculator


def decode_rows(running: list[Request], plan: Plan, speculator: Speculator | None) -> list[Row]:
    """A row for each running request: a decode, or (speculating) its verification."""
    if speculator is None or not plan.draft_len:
        return [Row.decode(r) for r in running]
    return [Row.speculating(r, p) if p else Row.decode(r)
            for r, p in zip(running, speculator.proposals(running, plan.draft_len))]


def check_request(engine, pages: BlockManager | None, ids: list[int], sampling: SamplingParams) -> None:
    """Refuse (ValueError) a request this engine could never run."""
    vocab = engine.model.config.vocab_size
    max_len = engine.max_len
    if not ids:
        raise ValueError("empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab] if min(ids) < 0 or max(ids) >= vocab else []
    if bad:
        raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
    if len(ids) >= max_len:
        raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate within "
                         f"max_seq_len={max_len}")
    bad = [t for t in sampling.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab}): {bad[:8]}")
    engine.check_sampling(sampling)
    if sampling.structured is not None and not engine.supports_structured_output:
        raise ValueError(f"structured output is not supported by this engine ({type(engine).__name__})")
    if pages is not None:
        # Positions it can write: its last token is returned, never written back (the
        # scheduler's decode reservations use the same cap).
        written = min(len(ids) + sampling.max_tokens - 1, max_len)
        if pages.pages_needed(written) > pages.num_pages:
            raise ValueError(f"a request of up to {written + 1} tokens writes {written} to the cache, "
                             f"{pages.pages_needed(written)} pages; the paged cache has "
                             f"{pages.num_pages}: it could never fit")


class EngineCore:
    def __init__(self, engine, scheduler: Scheduler, pages: BlockManager | None, clock: Callable[[], float],
                 overlap: bool = False):
        self.engine = engine
        self.scheduler = scheduler
        self.pages = pages
        self.clock = clock
        self.overlap = overlap
        self.stats = StepStats()
        self.last_plan: Plan | None = None
        self._ahead: jax.Array | None = None  # a decode call dispatched before the last one was recorded
        self._ahead_rows: tuple[list[int], list[Row]] | None = None  # the slots it names, and its rows
        # Prompt token ids -> expected output tokens, for the length-aware orderings (a
        # `LengthPredictor`, or a trace's known lengths); None: requests carry max_tokens only.
        self.predict_len: Callable[[list[int]], int] | None = None
        # Whether requests have arrived that the front has not handed in yet (a server's queue);
        # None: the front hands requests in only between rounds (offline generate, replay).
        self.arrivals_pending: Callable[[], bool] | None = None
        self.speculator: Speculator | None = None  # speculative decoding's proposer and length policy

    # ------------------------------------------------------------ requests
    def check_request(self, ids: list[int], sampling: SamplingParams) -> None:
        """Refuse (ValueError) a request this engine could never run."""
        check_request(self.engine, self.pages, ids, sampling)

    def add(self, request: Request) -> None:
        if self.predict_len is not None and request.predicted_len is None:
            request.predicted_len = self.predict_len(request.prompt_token_ids)
        self.scheduler.add(request)

    def abort(self, request: Request) -> None:
        slot = request.slot
        self.scheduler.abort(request.request_id, self.clock())
        if slot is not None:
            self.engine.deactivate(slot)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def drain(self, draining: bool = True) -> None:
        """No more arrivals are coming (offline generation): static may run a partial batch."""
        self.scheduler.drain(draining)

    def warmup(self) -> int:
        """Compile every program this configuration can reach (the step per token bucket, the
        host tier's moves)."""
        count = self.engine.warmup() + (self.speculator.warmup() if self.speculator is not None else 0)
        host, host_kv = self.scheduler.host, self.engine.host_kv
        if host is not None and host_kv is not None:
            swap = self.scheduler.config.preemption_mode == "swap"
            count += host_kv.warmup(self.engine, pages=self.pages is not None and self.pages.host is not None, swap=swap)
        return count

    # --------------------------------------------------------------- hooks
    idle = property(lambda self: self.last_plan is not None and self.last_plan.idle)  # the latest round ran nothing

    @property
    def wake_time(self) -> float | None:
        """When idle: the earliest time something could change without an arrival."""
        return self.last_plan.wake_time if self.idle else None

    # A decode call runs ahead (overlap): the slots may not change until it is recorded.
    in_flight = property(lambda self: self._ahead is not None)

    def load(self) -> Load:
        return Load.of(self.scheduler, self.pages, self.speculator, self.stats.expert_tokens)

    @contextlib.contextmanager
    def engine_swapped(self, engine):
        """Run rounds on another engine over the same state (the profiler's shadowed one)."""
        real, self.engine = self.engine, engine
        try:
            yield engine
        finally:
            self.engine = real

    # --------------------------------------------------------------- round
    def run_round(self) -> list[Request]:
        """One scheduling round; returns the requests it touched (got tokens or finished). A
        round that finds a decode call in flight (overlap) records it first; if requests wait
        to be admitted it goes on to schedule them in the same round, so an admitted request's
        first token comes out of the round that admitted it."""
        return end_failed_constraints(self, self._round())

    def _round(self) -> list[Request]:
        touched: dict[str, Request] = {}
        if self._ahead is not None:
            self._ahead_round(touched)
            if self._ahead is not None or not self.scheduler.waiting:
                return list(touched.values())
        sched, engine, stats = self.scheduler, self.engine, self.stats
        t0, started = time.perf_counter(), self.clock()  # the clock: simulated time in a simulation
        speculator = self.speculator
        plan = sched.schedule(started, speculator.next_length(len(sched.running)) if speculator else 0)
        self.last_plan = plan
        t1 = time.perf_counter()
        stats.schedule_s += t1 - t0
        if plan.idle:
            return list(touched.values())
        for slot in plan.preempted_slots:
            engine.deactivate(slot)
        if plan.kv_ops:  # swaps and prefix pages to and from host memory, before anything writes
            engine.move_kv(plan.kv_ops)
        if plan.copies:
            engine.copy_kv(plan.copies)
        if self.pages is not None and engine.reads_block_tables:
            engine.set_block_tables(block_tables(self))
        running = RequestState.RUNNING
        if plan.mixed and plan.prefills:  # one step: the plan's chunks, then a decode row per running request
            rows = plan.prefills + decode_rows([r for r in sched.running if r.state == running], plan, speculator)
            calls = [(engine.run(rows), rows)]
        else:  # prefill_first: a step of prompt rows, then one of decode rows (a mixed plan's
            # round without prompt rows too, so that it may run ahead)
            calls = [(engine.run(plan.prefills), plan.prefills)] if plan.prefills else []
            # A prefill whose first token is its last joins no decode (alone, one that computes nothing).
            ending = [c.request for c in plan.prefills if c.is_last and _decodes_after_prefill(c.request)]
            finishing = {r.request_id for r in ending}
            if any(r.grammar is not None for r in ending):
                # A constrained one's mask needs its first token on the host: record the prompt rows
                # before dispatching the decode (one sync, rather than a step later for its second token).
                t1, calls = self._record(calls, t1, touched), []
            live = [r for r in sched.slots if r is not None and (r.state == running or r.request_id in finishing)]
            if plan.decode and live:
                rows = decode_rows(live, plan, speculator)
                # A constrained row's mask follows the token before it, a verify row's end is the
                # host's to read: one step per call.
                one = any(r.grammar is not None for r in live) or any(r.verify for r in rows)
                calls.append((engine.run(rows, 1 if one else engine.config.decode_steps), rows))
                if not plan.prefills and not one:
                    t1 += self._run_ahead(calls[-1][0])
        t_end = self._record(calls, t1, touched)
        self._count_round(plan, t_end)
        if speculator is not None:
            speculator.after_round([rows for _, rows in calls], plan.draft_len,
                                   None if plan.prefills else self.clock() - started, touched.values())
        return list(touched.values())

    def _record(self, calls, t_dispatch: float, touched: dict[str, Request]) -> float:
        """The one record path: copy every call's result to the host at once, then hand each
        row's tokens to the scheduler (prompt rows first, so a request whose prompt ended
        this round is running when its decode tokens are recorded)."""
        stats = self.stats
        t2 = time.perf_counter()
        host, expert_tokens = to_host(([[out for out, _ in dispatched] for dispatched, _ in calls],
                                       self.engine.take_expert_tokens()), self.engine.platform)
        now = self.clock()
        t3 = time.perf_counter()
        stats.dispatch_s += t2 - t_dispatch
        stats.device_wait_s += t3 - t2
        if expert_tokens:  # a mixture of experts' routing, copied with the tokens
            stats.count_expert_tokens(expert_tokens)
        record_round(self.scheduler, stats, self.engine.num_slots, self.speculator, calls, host, now, touched)
        return t3

    def _run_ahead(self, in_flight: list) -> float:
        """Host/device overlap: with a decode call in flight and nothing to admit, dispatch the
        next decode call now (decode rows read each slot's last token and length on the
        device), so the device runs it while the host records the one in flight. A sequence
        that finishes in the call in flight is inactive on the device by then, so the extra
        call computes nothing for it; its row comes back -1 and outputs are unchanged.

        With a front whose requests arrive at any time (`arrivals_pending`), the next call is
        dispatched when the one in flight has finished, and only if nothing arrived meanwhile:
        queued behind it at once, it would make a request that arrives during the call in
        flight wait for two decode calls before its prefill instead of the rest of one. The
        host's recording still overlaps the next call; the device idles only while it is
        dispatched. Returns the seconds it waited for the device."""
        steps = self.engine.config.decode_steps
        # Not while requests speculate: a proposal needs the tokens of the call in flight.
        speculates = self.speculator is not None and self.speculator.length(len(self.scheduler.running)) > 0
        slots = slots_to_run_ahead(self.scheduler, steps) if (
            self.overlap and self.engine.can_run_ahead and not speculates) else None
        if slots is None:
            return 0.0
        # Rows by slot alone: the call may outlive its requests (nothing else holds them then).
        # The same rows round after round while the holders stay: made once.
        if self._ahead_rows is None or self._ahead_rows[0] != slots:
            self._ahead_rows = (slots, [Row(slot, [], 0) for slot in slots])
        rows = self._ahead_rows[1]
        waited = 0.0
        if self.arrivals_pending is not None:
            t0 = time.perf_counter()
            jax.block_until_ready([out for out, _ in in_flight])
            waited = time.perf_counter() - t0
            self.stats.device_wait_s += waited
            if self.arrivals_pending():
                return waited
        self._ahead = (self.engine.run(rows, steps), rows)
        self.stats.ahead_calls += 1
        return waited

    def _ahead_round(self, touched: dict[str, Request]) -> None:
        """Record the decode call the previous round dispatched ahead, after dispatching the
        next one if it may run ahead too."""
        ahead, self._ahead = self._ahead, None
        t1 = time.perf_counter()
        t1 += self._run_ahead(ahead[0])
        self._count_round(self.last_plan, self._record([ahead], t1, touched))

    def _count_round(self, plan: Plan, t_recorded: float) -> None:
        self.stats.rounds += 1
        self.stats.prefill_chunks += len(plan.prefills)
        self.stats.prefill_tokens += sum(c.length for c in plan.prefills)
        self.stats.process_s += time.perf_counter() - t_recorded


def slots_to_run_ahead(sched: Scheduler, steps: int) -> list[int] | None:
    """The slots a decode call may be dispatched for before the one in flight is recorded, or
    None: not while requests wait, a holder is prefilling or constrained (its next mask needs
    this call's token on the host first), or (paged) the next call would grow a table (the
    scheduler reserves, or preempts, first)."""
    holders = [r for r in sched.slots if r is not None]
    if sched.waiting or not holders or any(r.state != RequestState.RUNNING or r.grammar is not None
                                           for r in holders):
        return None
    after = [r.num_tokens + steps for r in holders]  # tokens each will have when the call in flight is recorded
    if sched.pages is not None and not all(map(sched.reservations.covers, holders, after)):
        return None
    return [r.slot for r in holders]


def block_tables(core: EngineCore) -> np.ndarray:
    tables = np.zeros((core.engine.num_slots, core.engine.max_len // core.pages.page_size), np.int32)
    for slot, r in enumerate(core.scheduler.slots):
        if r is not None:
            pages = core.pages.tables[r.request_id]
            tables[slot, :len(pages)] = pages
    return tables


def _decodes_after_prefill(request) -> bool:
    """Whether a request still has tokens to make after the one its last prefill chunk samples."""
    return request.sampling.max_tokens - len(request.output_token_ids) > 1


def end_failed_constraints(core: EngineCore, touched: list[Request]) -> list[Request]:
    """End with an error the requests whose structured-output matcher failed this round (past
    its work bounds, cbjax/grammar.py): its mask then allowed only EOS, so the answer would
    otherwise end as a truncated "stop" that breaks its own constraint."""
    for r in touched:
        error = r.grammar.error if r.grammar is not None and r.finish_reason != FinishReason.ABORT else None
        if error is not None:
            if not r.finished:
                core.abort(r)
            r.finish_reason, r.error = FinishReason.ERROR, error
    return touched
