"""`SchedulerConfig`: the batching policy and its knobs, checked when made."""

from __future__ import annotations

import dataclasses

from cbjax import checks

POLICIES = ("static", "dynamic", "continuous")
# fcfs: arrival; priority: lower `priority` first (vLLM's convention), then arrival; score:
# source note 004's score, highest first; sjf: shortest predicted remaining output first.
ORDERINGS = ("fcfs", "priority", "score", "sjf")
MERGE_MODES = ("prefill_first", "fused", "chunked")
PREEMPTION_MODES = ("recompute", "swap")


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
    # ordering="score" (source note 004): score = score_wait x seconds waited
    # + score_short / predicted remaining tokens - score_priority x priority (lower priority
    # values are more important), the note's weights by default. score_wait > 0 is aging: a
    # waiting request's score grows until it outranks every later arrival.
    score_wait: float = 1.0
    score_short: float = 0.5
    score_priority: float = 2.0
    # priority / score orderings (continuous policy): a waiting request that outranks the least
    # important request holding a slot takes that slot when none is free (the other is
    # preempted and recomputed later, as in vLLM's priority policy).
    priority_preemption: bool = True
    length_aware: bool = False
    decode_steps: int = 1
    # How prefill meets decode: "prefill_first" (prefill calls, then a decode call), "fused"
    # (Orca: whole new prompts in the same step as the decodes) or "chunked" (Sarathi-Serve:
    # decodes first, then prompt chunks, within `max_num_batched_tokens` tokens per step).
    merge_mode: str = "prefill_first"
    max_num_batched_tokens: int | None = None
    # What a preempted decoding request keeps: nothing ("recompute": its tokens are prefilled
    # again, vLLM's default) or its KV and state, in the host tier ("swap").
    preemption_mode: str = "recompute"
    # Speculative decoding: the most tokens proposed per request and step. A speculating
    # request's step writes up to this many positions past a decode's: the paged cache's
    # look-ahead and the mixed step's token budget count them.
    num_speculative_tokens: int = 0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, got {self.ordering!r}")
        for name in ("score_wait", "score_short", "score_priority"):
            setattr(self, name, checks.real(name, getattr(self, name), 0.0))
        if not isinstance(self.priority_preemption, bool):
            raise ValueError(f"priority_preemption must be a bool, got {self.priority_preemption!r}")
        self.num_slots = checks.integer("num_slots", self.num_slots, 1)
        if self.batch_size is None:
            self.batch_size = self.num_slots
        self.batch_size = checks.integer("batch_size", self.batch_size, 1, self.num_slots)
        self.num_speculative_tokens = checks.integer("num_speculative_tokens", self.num_speculative_tokens, 0, 64)
        for name in ("refill_interval", "decode_steps", "max_waiting_steps"):
            setattr(self, name, checks.integer(name, getattr(self, name), 1))
        self.window_ms = checks.real("window_ms", self.window_ms, 0.0)
        self.waiting_served_ratio = checks.real("waiting_served_ratio", self.waiting_served_ratio, 0.0)
        if self.max_prefill_tokens is not None:
            self.max_prefill_tokens = checks.integer("max_prefill_tokens (or None)", self.max_prefill_tokens, 1)
        if not isinstance(self.length_aware, bool):
            raise ValueError(f"length_aware must be a bool, got {self.length_aware!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
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
