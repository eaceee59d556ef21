"""A core's state as one read-only copy (`Core.snapshot()`): what studies and tests read instead
of reaching into the engine, the scheduler or the page pool."""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Mapping

from cbjax.core.step_stats import Load, StepStats
from cbjax.scheduling.host_tier import HostTierStats


@dataclasses.dataclass(frozen=True)
class Snapshot:
    load: Load  # the counters a front reports (requests, cache usage, prefix hits, speculation)
    stats: StepStats  # where the rounds' time went, since the start or the last reset
    slots: tuple[str | None, ...]  # the request id holding each slot, or None
    page_tables: Mapping[str, tuple[int, ...]]  # paged cache: each request's pages, in order
    free_pages: int | None  # paged cache: pages free now; None: the slot cache
    page_size: int | None
    host: HostTierStats | None  # the host tier's counters, or None without one
    host_link_s: float  # a simulated engine's seconds of KV moves over the host link (0 elsewhere)
    call_log: tuple[tuple, ...]  # a pipeline engine's rounds of stage calls, in dispatch order; () elsewhere
    trace_counts: Mapping[tuple, int]  # step programs traced in this process, by program key


def snapshot_of(engine, scheduler, pages, load: Load, stats: StepStats) -> Snapshot:
    from cbjax.runtime.traced.device_state import TRACE_COUNTS

    host = scheduler.host
    return Snapshot(
        load=load,
        stats=copy.deepcopy(stats),
        slots=tuple(None if r is None else r.request_id for r in scheduler.slots),
        page_tables=types.MappingProxyType({} if pages is None else {k: tuple(v) for k, v in pages.tables.items()}),
        free_pages=None if pages is None else pages.num_free,
        page_size=None if pages is None else pages.page_size,
        host=None if host is None else dataclasses.replace(host.stats),
        host_link_s=float(engine.host_s),
        call_log=tuple(tuple(r) for r in engine.call_log),
        trace_counts=types.MappingProxyType(dict(TRACE_COUNTS)))
