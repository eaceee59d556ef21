"""The engine core: one scheduling round between the front door and the scheduler/engine.

A step is three calls, as vLLM v1's: the scheduler plans the round (`schedule`: its prompt
chunks, decode rows, speculation's proposals, the device calls they make), the executor runs
the plan on the device and copies the results to the host once (`execute`), and the
scheduler records them into its requests (`update`). Host/device overlap is a loop of its
own (`step_ahead`): it records a decode call dispatched ahead of the last record. The front
door (`LLM`) only takes requests in and hands outputs out; the server loop, the replicas
front and the simulator's profiler use this class's public hooks (`load`, `idle`,
`wake_time`, `run_round`, `engine_swapped`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

from cbjax.core.engine_queries import EngineQueries
from cbjax.core.executor import Executor
from cbjax.core.lora_admin import LoraAdmin
from cbjax.core.step_stats import Load, StepStats
from cbjax.request import Request, SamplingParams
from cbjax.scheduling import BlockManager, Plan, RoundResult, Scheduler


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


class EngineCore(EngineQueries, LoraAdmin):
    def __init__(self, engine, scheduler: Scheduler, pages: BlockManager | None, clock: Callable[[], float],
                 overlap: bool = False):
        self.scheduler = scheduler
        self.pages = pages
        self.clock = clock
        self.executor = Executor(engine, pages, clock, StepStats(), overlap)
        self.idle = False  # the latest round ran nothing
        self.wake_time: float | None = None  # when idle: the earliest time something could change without an arrival
        # Prompt token ids -> expected output tokens, for the length-aware orderings (a
        # `LengthPredictor`, or a trace's known lengths); None: requests carry max_tokens only.
        self.predict_len: Callable[[list[int]], int] | None = None

    engine = property(lambda self: self.executor.engine)

    @property
    def stats(self) -> StepStats:
        """Since the start or the last reset: where the rounds' time went."""
        return self.executor.stats

    @stats.setter
    def stats(self, stats: StepStats) -> None:
        self.executor.stats = stats

    @property
    def arrivals_pending(self) -> Callable[[], bool] | None:
        """Whether requests have arrived that the front has not handed in yet (a server's queue);
        None: the front hands requests in only between rounds (offline generate, replay)."""
        return self.executor.arrivals_pending

    @arrivals_pending.setter
    def arrivals_pending(self, pending: Callable[[], bool] | None) -> None:
        self.executor.arrivals_pending = pending

    # ------------------------------------------------------------ requests
    def check_request(self, ids: list[int], sampling: SamplingParams) -> None:
        """Refuse (ValueError) a request this engine could never run."""
        check_request(self.engine, self.pages, ids, sampling)

    def add(self, request: Request) -> None:
        predicted = self.predict_len(request.prompt_token_ids) if self.predict_len is not None else None
        self.scheduler.add(request, predicted)

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

    def warmup(self) -> int:
        """Compile every program this configuration can reach (the step per token bucket, the
        host tier's moves)."""
        speculator = self.scheduler.speculator
        count = self.engine.warmup() + (speculator.warmup() if speculator is not None else 0)
        host, host_kv = self.scheduler.host, self.engine.host_kv
        if host is not None and host_kv is not None:
            swap = self.scheduler.config.preemption_mode == "swap"
            count += host_kv.warmup(self.engine, pages=self.pages is not None and self.pages.host is not None, swap=swap)
        return count

    # --------------------------------------------------------------- hooks
    # A decode call runs ahead (overlap): the slots may not change until it is recorded.
    in_flight = property(lambda self: self.executor.ahead is not None)

    def load(self) -> Load:
        return Load.of(self.scheduler, self.pages, self.scheduler.speculator, self.stats.expert_tokens)

    @contextlib.contextmanager
    def engine_swapped(self, wrap: Callable):
        """Run rounds on `wrap(engine)` over the same state (the profiler's shadowed engine)."""
        real = self.executor.engine
        engine = self.executor.engine = wrap(real)
        try:
            yield engine
        finally:
            self.executor.engine = real

    # --------------------------------------------------------------- round
    def run_round(self) -> list[Request]:
        """One scheduling round; returns the requests it touched (got tokens or finished). A
        round that finds a decode call in flight (overlap) records it first; if requests wait
        to be admitted it goes on to schedule them in the same round, so an admitted request's
        first token comes out of the round that admitted it."""
        if not self.in_flight:
            return self.step()
        touched = self.step_ahead()
        if self.in_flight or not self.scheduler.waiting:
            return touched
        more = self.step()
        return list({r.request_id: r for r in touched + more}.values())

    def step(self) -> list[Request]:
        """Schedule, execute, update."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self.clock(), run_ahead=self.executor.may_run_ahead)
        self.idle, self.wake_time = plan.idle, plan.wake_time
        self.stats.schedule_s += time.perf_counter() - t0
        if plan.idle:
            return plan.failed
        result = self.executor.execute(plan, self.scheduler.slots)
        return plan.failed + self._update(plan, result)

    def step_ahead(self) -> list[Request]:
        """The overlap loop's step: record the decode call dispatched ahead of the last record,
        after dispatching the next one if it may run ahead too."""
        plan = self.scheduler.plan_in_flight(self.executor.ahead[1], self.clock(), self.executor.may_run_ahead)
        result = self.executor.execute(plan, self.scheduler.slots)
        return self._update(plan, result)

    def _update(self, plan: Plan, result: RoundResult) -> list[Request]:
        t0 = time.perf_counter()
        outcome = self.scheduler.update(plan, result)
        stats = self.stats
        stats.rounds += 1
        stats.prefill_chunks += len(plan.prefills)
        stats.prefill_tokens += sum(c.length for c in plan.prefills)
        stats.active_slot_steps += outcome.decode_tokens
        stats.decode_steps += outcome.decode_steps
        stats.process_s += time.perf_counter() - t0
        return outcome.requests
