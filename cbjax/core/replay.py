"""The arrival loop every front shares (`LLM`, `Replicas`): admit each request of a
workload at its arrival time, run rounds meanwhile, sleep when there is nothing to do.

A front offers `clock()`, `add_request(prompt, sampling, arrival_time=...)`,
`has_unfinished_requests()`, `drain(bool)`, `finish_round()` (run one round; return what
finished in it) and the `idle` / `wake_time` of its latest round.
"""

from __future__ import annotations

import time
from typing import Sequence


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
                 catch_errors: bool = False, concurrency: int | None = None
                 ) -> tuple[list[str | None], dict[int, str], list]:
    """Admit each `(arrival_offset_s, prompt, sampling)` of `workload` at `start + offset`
    on the front's clock (`realtime`), or all before the first round, and run rounds until
    nothing is unfinished. `concurrency`: a closed-loop client instead, which keeps that
    many requests in flight (in workload order, offsets ignored) and sends the next one
    the moment one finishes, as `vllm bench serve --max-concurrency` and AIPerf do.
    A refused request raises, or with `catch_errors` is recorded. Returns the request ids
    in workload order (None where refused), the refusals' messages by workload index, and
    what finished, in finishing order."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    order = sorted(range(len(workload)), key=lambda i: workload[i][0])
    ids: list[str | None] = [None] * len(workload)
    errors: dict[int, str] = {}
    finished: list = []
    start, pending = front.clock(), 0
    if concurrency is not None:
        order = list(range(len(workload)))
    in_flight: dict[str, int] = {}  # closed loop: request id -> samples still running
    try:
        while pending < len(order) or front.has_unfinished_requests():
            now = front.clock()
            while pending < len(order) and (
                    len(in_flight) < concurrency if concurrency is not None
                    else not realtime or start + workload[order[pending]][0] <= now):
                i = order[pending]
                offset, prompt, sampling = workload[i]
                try:
                    arrival = now if concurrency is not None else start + offset if realtime else None
                    ids[i] = front.add_request(prompt, sampling, arrival_time=arrival)
                    if concurrency is not None:
                        in_flight[ids[i]] = getattr(sampling, "n", 1) or 1
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
            if concurrency is not None:
                for r in done:
                    _retire(in_flight, r.request_id)
                if pending < len(order) and len(in_flight) < concurrency:
                    continue  # the closed-loop client sends its next request now
            if front.idle and (pending < len(order) or front.has_unfinished_requests()):
                next_arrival = (start + workload[order[pending]][0]
                                if pending < len(order) and concurrency is None else None)
                wakes = [t for t in (next_arrival, front.wake_time) if t is not None]
                sleep_until(front.clock, min(wakes) if wakes else None)
    finally:
        bar.close()
        front.drain(False)
    return ids, errors, finished


def _retire(in_flight: dict[str, int], request_id: str) -> None:
    """A request finished: a sample `"{id}/{i}"` counts for its group, which stays in
    flight until its last sample ends."""
    if request_id not in in_flight:
        request_id = request_id.rsplit("/", 1)[0]
    if request_id in in_flight:
        in_flight[request_id] -= 1
        if in_flight[request_id] <= 0:
            del in_flight[request_id]
