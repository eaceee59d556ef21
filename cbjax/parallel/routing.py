"""Which replica a request goes to (`Replicas`' routing policies):

- `round_robin`: the next replica in turn.
- `least_loaded`: the replica with the least queued work, scored as vLLM's
  data-parallel balancer does (4 x waiting + running).
- `prefix_affinity`: requests whose first `affinity_tokens` prompt tokens agree go to
  the same replica (a hash of them), so its prefix cache sees every request of a
  shared system prompt; a replica more than `affinity_slack` requests busier than the
  least loaded one is passed over for it (SGLang's cache-aware router does the same).
"""

from __future__ import annotations

import zlib
from typing import Callable, Sequence

from cbjax import checks
from cbjax.core.step_stats import Load

ROUTING = ("round_robin", "least_loaded", "prefix_affinity")


class Router:
    def __init__(self, routing: str, affinity_tokens: int, affinity_slack: int | None):
        """Checked before any replica is built; `attach` then gives it the replicas' loads."""
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
        self.routing = routing
        self.affinity_tokens = checks.integer("affinity_tokens", affinity_tokens, 1)
        self.affinity_slack = None if affinity_slack is None else checks.integer("affinity_slack", affinity_slack, 0)
        self.loads: Sequence[Callable[[], Load]] = ()  # each replica's `load`
        self.routed: list[int] = []  # requests sent to each replica
        self.accepted = 0  # requests routed so far: round robin's turn

    def attach(self, loads: Sequence[Callable[[], Load]], num_slots: int) -> None:
        """Route over replicas with these `load`s (`affinity_slack` defaults to a replica's slots)."""
        self.loads = loads
        self.routed = [0] * len(loads)
        if self.affinity_slack is None:
            self.affinity_slack = num_slots

    @property
    def reads_prompt(self) -> bool:
        """Whether `route` needs the prompt's token ids."""
        return self.routing == "prefix_affinity"

    def queued_work(self, i: int) -> int:
        load = self.loads[i]()
        return 4 * load.waiting + load.running

    def route(self, prompt_ids: list[int] | None) -> int:
        """The replica a request goes to (only prefix affinity reads its prompt tokens)."""
        n = len(self.loads)
        if self.routing == "round_robin":
            return self.accepted % n
        least = min(range(n), key=lambda i: (self.queued_work(i), i))
        if self.routing == "least_loaded":
            return least
        key = ",".join(map(str, prompt_ids[:self.affinity_tokens])).encode()
        preferred = zlib.crc32(key) % n
        return preferred if self.queued_work(preferred) <= self.queued_work(least) + self.affinity_slack else least

    def routed_to(self, i: int) -> None:
        """A request went to replica `i`."""
        self.accepted += 1
        self.routed[i] += 1
