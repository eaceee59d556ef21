"""The order waiting requests start in, and which request may preempt which for rank.

Each ordering is a sort key (lower first) over requests: the waiting queue is kept sorted
by it and the least important holder of a slot is the one with the highest key.

- `fcfs`: arrival.
- `priority`: lower `priority` first (vLLM's convention), then arrival.
- `sjf`: fewest predicted remaining output tokens first (a length predictor's estimate,
  else the max_tokens budget: oracle SJF when max_tokens is the true length), then arrival.
- `score`: source note 004's score, highest first:
      score(r, now) = score_wait * (now - arrival) + score_short / predicted_remaining
                      - score_priority * priority
"""

from __future__ import annotations

import operator
from typing import Callable

from cbjax.request import Request

RANKED = ("priority", "score")  # orderings under which a waiting request may preempt a holder


def key_function(config) -> Callable[[Request], tuple]:
    """The sort key of `config.ordering`. The rank is its first element: requests of equal
    rank keep arrival order."""
    ordering = config.ordering
    if ordering == "priority":
        return lambda r: (r.priority, r.arrival_time, r.seq_index)
    if ordering == "sjf":
        return lambda r: (r.predicted_remaining, r.arrival_time, r.seq_index)
    if ordering == "score":
        wait, short, priority = config.score_wait, config.score_short, config.score_priority
        # Every waiting request's score grows at the same rate score_wait, so rescoring at any
        # later `now` never changes the order of two waiting requests: -score + score_wait * now
        # is a fixed key, and a queue sorted once stays sorted as it ages. Aging still works:
        # a later arrival's key is higher by score_wait per second, so any fixed priority gap
        # is overtaken (gap / score_wait seconds) and nothing starves.
        return lambda r: (wait * r.arrival_time - short / r.predicted_remaining + priority * r.priority,
                          r.arrival_time, r.seq_index)
    return operator.attrgetter("arrival_time", "seq_index")  # C: no Python frame per comparison


def score(config, r: Request, now: float) -> float:
    """Note 004's score of `r` at `now` (what `key_function` orders by, for reports)."""
    return (config.score_wait * (now - r.arrival_time) + config.score_short / r.predicted_remaining
            - config.score_priority * r.priority)


def preempts_for_rank(config) -> bool:
    """Whether a waiting request that outranks a holder takes its slot (continuous only:
    static and dynamic batches run to their end)."""
    return config.priority_preemption and config.policy == "continuous" and config.ordering in RANKED
