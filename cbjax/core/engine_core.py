"""The engine core: one scheduling round between the front door and the scheduler/engine.

A round asks the scheduler for a `Plan`, deactivates the slots it preempted, hands the
engine the paged block tables, runs the plan's rows (bucketed prefill calls and then a
decode call, or one mixed step), copies the results to the host once, and records them
with the scheduler. The front door (`LLM`) only takes requests in and hands outputs
out; the server loop, the replicas front and the simulator's profiler use this class's
public hooks (`load`, `idle`, `wake_time`, `run_round`, `engine_swapped`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import jax
import numpy as np

from cbjax.core.step_stats import StepStats
from cbjax.request import Request, RequestState, SamplingParams, TokenLogprob
from cbjax.runtime.programs import split_logprobs
from cbjax.scheduling import BlockManager, Plan, Row, Scheduler


@dataclasses.dataclass(frozen=True)
class Load:
    """What the engine holds after its latest round (the server's /metrics and queue limit,
    the replicas' routing)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of slots (slot cache) or pages (paged cache) in use
    num_preemptions: int = 0


def prefill_results(host_outs, rows_of_calls) -> tuple[dict, dict]:
    """Per chunk index: (first token, done), and its logprob columns when there are any."""
    firsts, logprobs_of = {}, {}
    for out, rows in zip(host_outs, rows_of_calls):
        out, logprobs = split_logprobs(out)
        for r, i in enumerate(rows):
            firsts[i] = (int(out[r, 0]), int(out[r, 1]))
            if logprobs is not None:
                logprobs_of[i] = logprobs[r]
    return firsts, logprobs_of


def add_logprobs(r: Request, columns) -> None:
    """Attach logprob columns (`[n, 1 + 2 max_logprobs]`, one per token the call sampled for
    `r`, in order) to the output tokens that have none yet; a request that asked for none
    gets none."""
    k = r.sampling.logprobs
    if k is None:
        return
    width = (columns.shape[-1] - 1) // 2 if len(columns) else 0
    start = len(r.logprobs)
    for token, row in zip(r.output_token_ids[start:], columns):
        top = tuple((int(i), float(v)) for v, i in zip(row[1:1 + k], row[1 + width:1 + width + k]))
        r.logprobs.append(TokenLogprob(token, float(row[0]), top))


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
        # Prompt token ids -> expected output tokens, for the length-aware orderings (a
        # `LengthPredictor`, or a trace's known lengths); None: requests carry max_tokens only.
        self.predict_len: Callable[[list[int]], int] | None = None

    # ------------------------------------------------------------ requests
    def check_request(self, ids: list[int], sampling: SamplingParams) -> None:
        """Refuse (ValueError) a request this engine could never run."""
        vocab = self.engine.model.config.vocab_size
        max_len = self.engine.max_len
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
        self.engine.check_sampling(sampling)
        if self.pages is not None:
            # Positions it can write: its last token is returned, never written back (the
            # scheduler's decode reservations use the same cap).
            written = min(len(ids) + sampling.max_tokens - 1, max_len)
            if self.pages.pages_needed(written) > self.pages.num_pages:
                raise ValueError(f"a request of up to {written + 1} tokens writes {written} to the cache, "
                                 f"{self.pages.pages_needed(written)} pages; the paged cache has "
                                 f"{self.pages.num_pages}: it could never fit")

    def add(self, request: Request) -> None:
        if self.predict_len is not None and request.predicted_len is None:
            request.predicted_len = self.predict_len(request.prompt_token_ids)
        self.scheduler.add(request)

    def abort(self, request: Request) -> None:
        slot = request.slot
        self.scheduler.abort(request.request_id, self.clock())
        if slot is not None:
            self.engine.deactivate(slot)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def drain(self, draining: bool = True) -> None:
        """No more arrivals are coming (offline generation): static may run a partial batch."""
        self.scheduler.drain(draining)

    def warmup(self, max_prompt_len: int | None = None) -> int:
        """Compile every program this configuration can reach: prefill continuations at any
        attended length when prompts can be chunked or resume from cached prefix pages."""
        chunked = self.scheduler.config.max_prefill_tokens is not None or (
            self.pages is not None and self.pages.enable_prefix_caching)
        return self.engine.warmup(chunked=chunked, max_prompt_len=max_prompt_len)

    # --------------------------------------------------------------- hooks
    idle = property(lambda self: self.last_plan is not None and self.last_plan.idle)  # the latest round ran nothing

    @property
    def wake_time(self) -> float | None:
        """When idle: the earliest time something could change without an arrival."""
        return self.last_plan.wake_time if self.idle else None

    # A decode call runs ahead (overlap): the slots may not change until it is recorded.
    in_flight = property(lambda self: self._ahead is not None)

    def load(self) -> Load:
        sched = self.scheduler
        running = sum(r is not None for r in sched.slots)
        if self.pages is not None:
            usage = 1.0 - self.pages.num_free / self.pages.num_pages
        else:
            usage = running / len(sched.slots)
        return Load(running, len(sched.waiting), usage, sched.num_preemptions)

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
        """One scheduling round; returns the requests it touched (got tokens or finished)."""
        if self._ahead is not None:
            return self._ahead_round()
        sched, engine, stats = self.scheduler, self.engine, self.stats
        t0 = time.perf_counter()
        plan = sched.schedule(self.clock())
        self.last_plan = plan
        t1 = time.perf_counter()
        stats.schedule_s += t1 - t0
        if plan.idle:
            return []
        for slot in plan.preempted_slots:
            engine.deactivate(slot)
        if plan.copies:
            engine.copy_kv(plan.copies)
        if self.pages is not None and engine.reads_block_tables:
            engine.set_block_tables(self._block_tables())
        if plan.mixed:
            return self._mixed_round(plan, t1)
        calls = engine.prefill(plan.prefills)
        decoded, running = None, RequestState.RUNNING
        # A prefill whose first token is its last joins no decode (alone, one that computes nothing).
        finishing = {c.request.request_id for c in plan.prefills if c.is_last and _decodes_after_prefill(c.request)}
        live = [r for r in sched.slots if r is not None and (r.state == running or r.request_id in finishing)]
        if plan.decode and live:
            longest = max(len(r.prompt_token_ids) + len(r.output_token_ids) + (r.state != running) for r in live)
            decoded = engine.decode(longest, [r.slot for r in live])
            if not calls:
                self._run_ahead()
        # The one host copy of the round: every prefill's (token, done) and the decode tokens.
        t2 = time.perf_counter()
        host_prefill, host_decode = jax.device_get(([out for out, _ in calls], decoded))
        now = self.clock()
        t3 = time.perf_counter()
        stats.dispatch_s += t2 - t1
        stats.device_wait_s += t3 - t2
        firsts, first_logprobs = prefill_results(host_prefill, [rows for _, rows in calls])
        touched = self._record_prefills(plan.prefills, [firsts[i] for i in range(len(plan.prefills))], now)
        for i, logprobs in first_logprobs.items():
            add_logprobs(plan.prefills[i].request, logprobs[None])
        if host_decode is not None:
            self._record_decode(host_decode, now, touched)
        self._count_round(plan, t3)
        return list(touched.values())

    def _run_ahead(self) -> None:
        """Host/device overlap: with a decode call in flight and nothing to admit, dispatch the
        next decode call now (the device state holds each slot's last token), so the device
        runs it while the host records the one in flight. A sequence that finishes in the call
        in flight is inactive on the device by then, so the extra call computes nothing for it;
        its row comes back -1 and outputs are unchanged."""
        sched, steps = self.scheduler, self.engine.config.decode_steps
        if not (self.overlap and getattr(self.engine, "can_run_ahead", False)) or sched.waiting:
            return
        holders = [r for r in sched.slots if r is not None]
        if not holders or any(r.state != RequestState.RUNNING for r in holders):
            return
        # Tokens each holder will have when the call in flight is recorded.
        after = [r.num_tokens + steps for r in holders]
        if self.pages is not None and not all(map(sched.reservations.covers, holders, after)):
            return  # the next call would grow a table: let the scheduler reserve (or preempt) first
        # decode caps the attended length at max_len
        self._ahead = self.engine.decode(max(after), [r.slot for r in holders])
        self.stats.ahead_calls += 1

    def _ahead_round(self) -> list[Request]:
        """A round whose decode call was dispatched by the previous round: dispatch the next
        one if it may run ahead too, then record this one."""
        out, self._ahead = self._ahead, None
        stats = self.stats
        t1 = time.perf_counter()
        self._run_ahead()
        t2 = time.perf_counter()
        host_decode = jax.device_get(out)
        now = self.clock()
        t3 = time.perf_counter()
        stats.dispatch_s += t2 - t1
        stats.device_wait_s += t3 - t2
        touched: dict[str, Request] = {}
        self._record_decode(host_decode, now, touched)
        self._count_round(self.last_plan, t3)
        return list(touched.values())

    def _record_decode(self, host_decode, now: float, touched: dict[str, Request]) -> None:
        sched, stats = self.scheduler, self.stats
        host_decode, logprobs = split_logprobs(host_decode)
        decoding = [r if r is not None and r.state == RequestState.RUNNING else None for r in sched.slots]
        mask = np.fromiter((r is not None for r in decoding), bool, len(decoding))
        idle = np.flatnonzero(mask & (host_decode[0] < 0))  # every running slot samples in step 0
        if idle.size:
            raise RuntimeError(f"engine and scheduler out of sync: slot {idle[0]} produced no token "
                               f"for running request {decoding[idle[0]].request_id!r}")
        sched.on_decode(host_decode.tolist(), now)
        if logprobs is not None:
            for slot, r in enumerate(decoding):
                if r is not None:
                    add_logprobs(r, logprobs[host_decode[:, slot] >= 0, slot])
        touched.update((r.request_id, r) for r in decoding if r is not None)
        stats.decode_steps += len(host_decode)
        stats.active_slot_steps += int((host_decode >= 0).sum())

    def _mixed_round(self, plan: Plan, t_dispatch: float) -> list[Request]:
        """The round as one mixed step: the plan's chunks, then a decode row per running request."""
        sched, stats = self.scheduler, self.stats
        decoding = [r for r in sched.running if r.state == RequestState.RUNNING]
        out = self.engine.mixed_step(plan.prefills + [Row.decode(r) for r in decoding])
        t2 = time.perf_counter()
        host, logprobs = split_logprobs(jax.device_get(out))  # the one host copy of the round
        now = self.clock()
        t3 = time.perf_counter()
        stats.dispatch_s += t2 - t_dispatch
        stats.device_wait_s += t3 - t2
        touched = self._record_prefills(plan.prefills, host[:len(plan.prefills)].tolist(), now)
        if decoding:
            per_slot = [-1] * self.engine.num_slots
            for r, (token, _) in zip(decoding, host[len(plan.prefills):].tolist()):
                per_slot[r.slot] = token
            sched.on_decode([per_slot], now)
            touched.update((r.request_id, r) for r in decoding)
            stats.decode_steps += 1
            stats.active_slot_steps += len(decoding)
        if logprobs is not None:
            for i, row in enumerate(plan.prefills + decoding):
                add_logprobs(row if isinstance(row, Request) else row.request, logprobs[i:i + 1])
        self._count_round(plan, t3)
        return list(touched.values())

    def _count_round(self, plan: Plan, t_recorded: float) -> None:
        self.stats.rounds += 1
        self.stats.prefill_chunks += len(plan.prefills)
        self.stats.process_s += time.perf_counter() - t_recorded

    def _record_prefills(self, chunks: list[Row], results, now: float) -> dict[str, Request]:
        """Hand each chunk's device result `(first token, done)` to the scheduler; returns the
        requests whose prompt ended (they got their first token), by id."""
        touched: dict[str, Request] = {}
        for chunk, (token, device_done) in zip(chunks, results):
            finished = self.scheduler.on_prefill(chunk, token if chunk.is_last else -1, now)
            if chunk.is_last:
                if bool(device_done) != finished:
                    raise RuntimeError(f"engine and scheduler disagree on whether "
                                       f"{chunk.request.request_id!r} finished")
                touched[chunk.request.request_id] = chunk.request
        return touched

    def _block_tables(self) -> np.ndarray:
        tables = np.zeros((self.engine.num_slots, self.engine.max_len // self.pages.page_size), np.int32)
        for slot, r in enumerate(self.scheduler.slots):
            if r is not None:
                pages = self.pages.tables[r.request_id]
                tables[slot, :len(pages)] = pages
        return tables


def _decodes_after_prefill(request) -> bool:
    """Whether a request still has tokens to make after the one its last prefill chunk samples."""
    return request.sampling.max_tokens - len(request.output_token_ids) > 1
