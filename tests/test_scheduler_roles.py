"""The disaggregated instances' schedulers (cbjax/scheduling/roles.py) under page pressure, with
a fake clock and no model: a prefill instance holds pages for prompts only (the decode instance
reserves the decodes' own), so it never preempts for a decode it will not run."""

from __future__ import annotations

import pytest

from cbjax.request import Request, RequestState, SamplingParams
from cbjax.scheduling.block_manager import BlockManager
from cbjax.scheduling.roles import PrefillScheduler
from cbjax.scheduling.scheduler import SchedulerConfig
from cbjax.scheduling.update import record_prefill

EOS = 2
PAGE = 4


@pytest.mark.parametrize("decode_steps, speculative", [(1, 0), (4, 0), (1, 3)])
def test_a_prefill_instance_never_reserves_decode_pages_nor_preempts_for_them(decode_steps, speculative):
    """Three prompts of exactly two pages each in a pool of six: all three prefill in one round
    and are held, prefilled, until their moves. A decode's look-ahead would want a third page
    apiece and preempt to get it."""
    pages = BlockManager(num_pages=6, page_size=PAGE)
    config = SchedulerConfig(policy="continuous", num_slots=3, decode_steps=decode_steps,
                             num_speculative_tokens=speculative)
    sched = PrefillScheduler(config, {EOS}, 64, pages=pages)
    requests = [Request(str(i), [5 + i] * (2 * PAGE), SamplingParams(max_tokens=16), 0.0) for i in range(3)]
    for r in requests:
        sched.add(r)
    now = 0.0
    for _ in range(4):  # the prefill round, then rounds that hold the prefilled requests
        plan = sched.schedule(now)
        assert not plan.decode
        for chunk in plan.prefills:
            record_prefill(sched, chunk, 10, now)
        now += 0.001
    assert sched.num_preemptions == 0
    assert [r.state for r in requests] == [RequestState.RUNNING] * 3
    assert sorted(r.request_id for r in sched.prefilled()) == ["0", "1", "2"]
    assert all(len(pages.tables[r.request_id]) == 2 for r in requests)


def test_a_prefill_instance_admits_a_prompt_that_fills_the_pool():
    """One prompt of all the pool's pages: a prefill instance takes it (its first decode runs
    on the decode instance, in that instance's pages)."""
    pages = BlockManager(num_pages=2, page_size=PAGE)
    sched = PrefillScheduler(SchedulerConfig(policy="continuous", num_slots=2), {EOS}, 64, pages=pages)
    r = Request("0", [7] * (2 * PAGE), SamplingParams(max_tokens=8), 0.0)
    sched.add(r)
    plan = sched.schedule(0.0)
    assert [c.request.request_id for c in plan.prefills] == ["0"]
