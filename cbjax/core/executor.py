"""A plan's device side: deactivate the slots it preempted, move and copy KV, hand the engine
the paged block tables, dispatch the plan's calls in order, maybe dispatch the next decode call
ahead (host/device overlap), and copy every call's result to the host at once."""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np

from cbjax.core.step_stats import StepStats
from cbjax.runtime.packing import split_logprobs, to_host
from cbjax.scheduling import BlockManager, Call, CallResult, Plan, RoundResult, Row


class Executor:
    def __init__(self, engine, pages: BlockManager | None, clock: Callable[[], float], stats: StepStats,
                 overlap: bool = False):
        self.engine = engine
        self.pages = pages
        self.clock = clock
        self.stats = stats
        self.overlap = overlap
        # Whether requests have arrived that the front has not handed in yet; None: the front
        # hands requests in only between rounds.
        self.arrivals_pending: Callable[[], bool] | None = None
        self.ahead: tuple[list, Call] | None = None  # a decode call dispatched before the last one was recorded
        self._ahead_call: Call | None = None  # the rows it named, kept while the slots stay

    @property
    def may_run_ahead(self) -> bool:
        return self.overlap and self.engine.can_run_ahead

    def execute(self, plan: Plan, holders: list) -> RoundResult:
        """Run the plan's calls (a plan `in_flight`: collect the call dispatched ahead) and
        return their results on the host. `holders`: the request in each slot, for the block
        tables."""
        t0 = time.perf_counter()
        if plan.in_flight:
            dispatched, self.ahead = [self.ahead[0]], None
        else:
            self._prepare(plan, holders)
            engine = self.engine
            dispatched = [engine.run(call.rows, call.steps) for call in plan.calls]
        waited = self._run_ahead(plan.ahead, dispatched) if plan.ahead is not None else 0.0
        return self._collect(dispatched, plan.calls, time.perf_counter() - t0 - waited)

    def _prepare(self, plan: Plan, holders: list) -> None:
        engine = self.engine
        for slot in plan.preempted_slots:
            engine.deactivate(slot)
        for slot, adapter in plan.lora_loads:  # LoRA adapters into the device pool, before a row reads them
            engine.load_adapter(slot, adapter)
        if plan.kv_ops:  # swaps and prefix pages to and from host memory, before anything writes
            engine.move_kv(plan.kv_ops)
        if plan.copies:
            engine.copy_kv(plan.copies)
        if self.pages is not None and engine.reads_block_tables:
            engine.set_block_tables(block_tables(holders, self.pages, engine.num_slots, engine.max_len))

    def _collect(self, dispatched: list, calls: list[Call], dispatch_s: float) -> RoundResult:
        """Copy every call's result to the host at once (one sync a round)."""
        stats = self.stats
        t0 = time.perf_counter()
        prompt_scores = self.engine.take_prompt_scores()
        host, expert_tokens, score_columns = to_host(([[out for out, _ in pieces] for pieces in dispatched],
                                                      self.engine.take_expert_tokens(),
                                                      [columns for columns, _ in prompt_scores]),
                                                     self.engine.platform)
        now = self.clock()
        stats.dispatch_s += dispatch_s
        stats.device_wait_s += time.perf_counter() - t0
        if expert_tokens:  # a mixture of experts' routing, copied with the tokens
            stats.count_expert_tokens(expert_tokens)
        for columns, (_, scored) in zip(score_columns, prompt_scores):  # prompt logprobs, copied with them too
            for scores, first, positions in scored:
                scores.fill(positions, columns[first:first + len(positions)])
        results = []
        for pieces, outs, call in zip(dispatched, host, calls):
            results.append(CallResult(call.rows, [(members, *split_logprobs(out))
                                                  for (_, members), out in zip(pieces, outs)]))
        return RoundResult(results, now)

    def _run_ahead(self, slots: list[int], in_flight: list) -> float:
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
        # Rows by slot alone: the call may outlive its requests (nothing else holds them then).
        # The same rows round after round while the holders stay: made once.
        if self._ahead_call is None or [r.slot for r in self._ahead_call.rows] != slots:
            self._ahead_call = Call([Row(slot, [], 0) for slot in slots], steps)
        waited = 0.0
        if self.arrivals_pending is not None:
            t0 = time.perf_counter()
            jax.block_until_ready([out for pieces in in_flight for out, _ in pieces])
            waited = time.perf_counter() - t0
            self.stats.device_wait_s += waited
            if self.arrivals_pending():
                return waited
        self.ahead = (self.engine.run(self._ahead_call.rows, steps), self._ahead_call)
        self.stats.ahead_calls += 1
        return waited


def block_tables(holders: list, pages: BlockManager, num_slots: int, max_len: int) -> np.ndarray:
    """Each slot's page table, as the engine's `[slots, max_len / page_size]` array."""
    tables = np.zeros((num_slots, max_len // pages.page_size), np.int32)
    for slot, r in enumerate(holders):
        if r is not None:
            table = pages.tables[r.request_id]
            tables[slot, :len(table)] = table
    return tables
