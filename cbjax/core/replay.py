"""The arrival loop every front shares (`LLM`, `Replicas`): admit each request of a
workload at its arrival time, run rounds meanwhile, sleep when there is nothing to do.

A front offers `clock()`, `add_request(prompt, sampling, arrival_time=...)`,
`has_unfinished_requests()`, `drain(bool)`, `finish_round()` (run one round; return what
finished in it) and the `idle` / `wake_time` of its latest round.
"""

from __future__ import annotations

import time
from typing import Sequence


def progress_bar(total: int | None, use_tqdm: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not use_tqdm, unit="req")


def sleep_until(clock, wake_time: float | None, cap: float = 0.05) -> None:
    """Wait for `wake_time` on `clock`, at most `cap` seconds; a simulated clock jumps."""
    now = clock()
    if hasattr(clock, "advance"):  # simulated time jumps straight to the wake-up
        clock.advance(cap if wake_time is None else wake_time - now)
        return
    delay = cap if wake_time is None else min(max(wake_time - now, 0.0), cap)
    if delay > 0:
        time.sleep(delay)


def run_arrivals(front, workload: Sequence[tuple], bar, *, realtime: bool = True,
                 catch_errors: bool = False) -> tuple[list[str | None], dict[int, str], list]:
    """Admit each `(arrival_offset_s, prompt, sampling)` of `workload` at `start + offset`
    on the front's clock (`realtime`), or all before the first round, and run rounds until
    nothing is unfinished. A refused request raises, or with `catch_errors` is recorded.
    Returns the request ids in workload order (None where refused), the refusals'
    messages by workload index, and what finished, in finishing order."""
    order = sorted(range(len(workload)), key=lambda i: workload[i][0])
    ids: list[str | None] = [None] * len(workload)
    errors: dict[int, str] = {}
    finished: list = []
    start, pending = front.clock(), 0
    try:
        while pending < len(order) or front.has_unfinished_requests():
            now = front.clock()
            while pending < len(order) and (not realtime or start + workload[order[pending]][0] <= now):
                i = order[pending]
                offset, prompt, sampling = workload[i]
                try:
                    ids[i] = front.add_request(prompt, sampling, arrival_time=start + offset if realtime else None)
                except ValueError as e:
                    if not catch_errors:
                        raise
                    errors[i] = str(e)
                    bar.update(1)
                pending += 1
            front.drain(pending == len(order))
            done = front.finish_round()
            finished += done
            bar.update(len(done))
            if front.idle and (pending < len(order) or front.has_unfinished_requests()):
                next_arrival = start + workload[order[pending]][0] if pending < len(order) else None
                wakes = [t for t in (next_arrival, front.wake_time) if t is not None]
                sleep_until(front.clock, min(wakes) if wakes else None)
    finally:
        bar.close()
        front.drain(False)
    return ids, errors, finished
