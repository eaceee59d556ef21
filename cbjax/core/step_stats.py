"""What a core reports: where the host loop's time goes (`StepStats`, summed over rounds)
and what its engine holds after its latest round (`Load`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from cbjax.scheduling import BlockManager, Scheduler


@dataclasses.dataclass
class StepStats:
    """Where the host loop's time goes (seconds, summed over rounds)."""

    rounds: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (cached prefix pages and forks are not; recomputes are)
    schedule_s: float = 0.0  # Scheduler.schedule
    dispatch_s: float = 0.0  # enqueueing the jitted steps (async)
    device_wait_s: float = 0.0  # waiting for the round's one host copy
    process_s: float = 0.0  # recording tokens, stop checks, building outputs
    active_slot_steps: int = 0  # sum over decode steps of slots that produced a token
    ahead_calls: int = 0  # decode calls dispatched before the previous one was recorded (overlap)
    # A mixture of experts: tokens each MoE layer sent to each expert, `[MoE layers, experts]`
    # (a new array each round, so a `Load` holding one keeps its snapshot); None for a dense model.
    expert_tokens: Any = None

    def count_expert_tokens(self, rounds: list) -> None:
        for counts in rounds:
            self.expert_tokens = summed_counts(self.expert_tokens, np.asarray(counts, np.int64))

    def __add__(self, other: "StepStats") -> "StepStats":
        """Two cores' stats as one (a disaggregated core's instances)."""
        out = StepStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                           for f in dataclasses.fields(StepStats) if f.name != "expert_tokens"})
        out.expert_tokens = summed_counts(self.expert_tokens, other.expert_tokens)
        return out

    @property
    def expert_imbalance(self) -> float:
        return expert_imbalance(self.expert_tokens)

    @property
    def mean_running(self) -> float:
        """Mean number of sequences decoding per decode step (batch utilization)."""
        return self.active_slot_steps / max(self.decode_steps, 1)

    @property
    def host_s(self) -> float:
        """Scheduler and bookkeeping time: what the device would idle for without overlap."""
        return self.schedule_s + self.process_s

    def host_ms_per_decode_step(self) -> float:
        return 1000 * self.host_s / max(self.decode_steps, 1)


def summed_counts(a, b):
    """Two tokens-per-expert arrays (or None) summed: a new array, so a `Load` holding one keeps it."""
    return b if a is None else a if b is None else a + b


def expert_imbalance(tokens) -> float:
    """The busiest expert's tokens over the mean expert's, averaged over the MoE layers (1: balanced);
    0 before any token."""
    if tokens is None or not np.size(tokens) or not np.sum(tokens):
        return 0.0
    tokens = np.asarray(tokens, np.float64)
    return float(np.mean(tokens.max(axis=1) / np.maximum(tokens.mean(axis=1), 1e-9)))


@dataclasses.dataclass(frozen=True)
class Load:
    """What the engine holds after its latest round (the server's /metrics and queue limit,
    the replicas' routing)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of slots (slot cache) or pages (paged cache) in use
    num_preemptions: int = 0
    # Since the start: full prompt pages looked up in the prefix cache, found on the device, found
    # in the host tier; preemptions swapped out, and those that fell back to recompute (host full).
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_host_hits: int = 0
    swaps_out: int = 0
    swap_fallbacks: int = 0
    host_kv_cache_usage: float = 0.0  # fraction of the host tier's bytes in use
    num_pages: int = 0  # the paged cache's pool (summed over engines); 0: the slot cache
    prefix_caching: bool = False
    # Speculative decoding since the start: verify rows (drafts), tokens proposed, tokens accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # LoRA adapters since the start (scheduling/adapter_slots.py's counters).
    lora_loads: int = 0
    lora_hits: int = 0
    lora_waits: int = 0
    lora_wait_s: float = 0.0
    # A mixture of experts since the start: tokens each MoE layer sent to each expert (StepStats's).
    expert_tokens: Any = dataclasses.field(default=None, compare=False)

    @property
    def expert_imbalance(self) -> float:
        return expert_imbalance(self.expert_tokens)

    @property
    def prefix_hit_rate(self) -> float:
        """Full prompt pages found on the device, of those looked up."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def prefix_host_hit_rate(self) -> float:
        """Full prompt pages found in the host tier, of those looked up."""
        return self.prefix_host_hits / self.prefix_queries if self.prefix_queries else 0.0

    @staticmethod
    def of(sched: Scheduler, pages: BlockManager | None, speculator=None, expert_tokens=None) -> "Load":
        """What `sched` holds now (and what `speculator`, the core's or None, did so far, and the
        experts' tokens, `StepStats.expert_tokens`)."""
        running = sum(r is not None for r in sched.slots)
        usage = 1.0 - pages.num_free / pages.num_pages if pages is not None else running / len(sched.slots)
        spec = {} if speculator is None else dict(spec_drafts=speculator.verify_rows,
                                                  spec_draft_tokens=speculator.proposed,
                                                  spec_accepted_tokens=speculator.accepted)
        lora = {} if sched.adapters is None else dict(
            lora_loads=sched.adapters.counters.loads, lora_hits=sched.adapters.counters.hits,
            lora_waits=sched.adapters.counters.waits, lora_wait_s=sched.adapters.counters.wait_s)
        return Load(running, len(sched.waiting), usage, sched.num_preemptions, **cache_counters(pages, sched.host),
                    **spec, **lora, expert_tokens=expert_tokens)

    @staticmethod
    def combine(loads: list["Load"]) -> "Load":
        """Several engines' loads as one: counts summed, usages averaged."""
        fields = {f.name: sum(getattr(x, f.name) for x in loads) for f in dataclasses.fields(Load)
                  if f.name not in ("expert_tokens", "prefix_caching")}
        fields["prefix_caching"] = any(x.prefix_caching for x in loads)
        fields["expert_tokens"] = functools.reduce(summed_counts, (x.expert_tokens for x in loads), None)
        for name in ("kv_cache_usage", "host_kv_cache_usage"):
            fields[name] /= max(len(loads), 1)
        return Load(**fields)


def cache_counters(pages: BlockManager | None, host) -> dict:
    """`Load`'s prefix-cache and host-tier counters."""
    out = {}
    if pages is not None:
        stats = pages.stats
        out.update(prefix_queries=stats.queries, prefix_hits=stats.hits, prefix_host_hits=stats.host_hits,
                   num_pages=pages.num_pages, prefix_caching=pages.enable_prefix_caching)
    if host is not None:
        out.update(swaps_out=host.stats.swaps_out, swap_fallbacks=host.stats.swap_fallbacks,
                   host_kv_cache_usage=host.used / host.capacity)
    return out
