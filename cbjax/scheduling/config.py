"""`SchedulerConfig`: the batching policy and its knobs, checked when made."""

from __future__ import annotations

import dataclasses

from cbjax import checks, knobs
from cbjax.knobs import knob

POLICIES = ("static", "dynamic", "continuous")
ORDERINGS = ("fcfs", "priority", "score", "sjf")
MERGE_MODES = ("prefill_first", "fused", "chunked")
PREEMPTION_MODES = ("recompute", "swap")


@dataclasses.dataclass
class SchedulerConfig:
    """The scheduler's knobs, each declared here once (`EngineArgs` takes them from here)."""

    policy: str = knob("continuous", "Batching policy: static, dynamic or continuous.", POLICIES)
    num_slots: int = knob(8, "KV-cache slots: sequences decoded together.", lower=1)
    batch_size: int | None = knob(None, "Static/dynamic batch size (default: num_slots).", lower=1)
    window_ms: float = knob(50.0, "Dynamic batching: wait at most this long after a batch's first arrival.",
                            lower=0.0)
    refill_interval: int = knob(1, "Continuous: decode steps between admissions.", lower=1)
    waiting_served_ratio: float = knob(0.0, "Continuous (TGI): waiting/running ratio at which prefills may "
                                       "interrupt decodes.", lower=0.0)
    max_waiting_steps: int = knob(20, "Continuous (TGI): decode steps a waiting prefill waits at most.", lower=1)
    max_prefill_tokens: int | None = knob(None, "Prompt tokens prefilled per round (chunked prefill); "
                                          "default whole prompts.", lower=1)
    # fcfs: arrival; priority: lower `priority` first (vLLM's convention), then arrival; score:
    # source note 004's score, highest first; sjf: shortest predicted remaining output first.
    ordering: str = knob("fcfs", "Admission order of waiting requests: fcfs, priority (lower first), score "
                         "(note 004: wait, predicted remaining length, priority) or sjf (shortest predicted "
                         "remaining output first).", ORDERINGS)
    # ordering="score" (source note 004): score = score_wait x seconds waited
    # + score_short / predicted remaining tokens - score_priority x priority (lower priority
    # values are more important), the note's weights by default. score_wait > 0 is aging: a
    # waiting request's score grows until it outranks every later arrival.
    score_wait: float = knob(1.0, "ordering=score: weight of each second waited (aging; 0 turns it off).",
                             lower=0.0)
    score_short: float = knob(0.5, "ordering=score: weight of 1 / predicted remaining output tokens.", lower=0.0)
    score_priority: float = knob(2.0, "ordering=score: weight of the priority (lower values rank higher).",
                                 lower=0.0)
    # As vLLM's priority policy: the preempted request is recomputed later.
    priority_preemption: bool = knob(True, "ordering=priority/score, continuous: a waiting request that outranks "
                                     "a running one takes its slot when none is free (recompute).")
    length_aware: bool = knob(False, "Static/dynamic: batch requests of similar expected length.")
    decode_steps: int = knob(1, "Decode steps per device call (the host syncs once per call).", lower=1)
    # "fused": whole new prompts in the same step as the decodes; "chunked": decodes first,
    # then prompt chunks, within `max_num_batched_tokens` tokens per step.
    merge_mode: str = knob("prefill_first", "How prefills meet running decodes: prefill_first, fused (Orca) "
                           "or chunked (Sarathi-Serve).", MERGE_MODES)
    max_num_batched_tokens: int | None = knob(None, "Token budget of a mixed step (fused/chunked); default "
                                              "max(256, 2 x slots) chunked, max_seq_len + slots fused.", lower=1)
    preemption_mode: str = knob("recompute", "What a preempted decoding request keeps: recompute (its tokens "
                                "are prefilled again, vLLM's default) or swap (its KV and state wait in host "
                                "memory, host_kv_cache_bytes).", PREEMPTION_MODES)
    # A speculating request's step writes up to this many positions past a decode's: the paged
    # cache's look-ahead and the mixed step's token budget count them.
    num_speculative_tokens: int = knob(0, "Speculation: the most tokens proposed per request and step (0: none).",
                                       lower=0, upper=64)

    def __post_init__(self):
        knobs.check(self)
        if self.batch_size is None:
            self.batch_size = self.num_slots
        self.batch_size = checks.integer("batch_size", self.batch_size, 1, self.num_slots)
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
