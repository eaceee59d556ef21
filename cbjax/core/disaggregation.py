"""Prefill/decode disaggregation (source note 002; DistServe, Splitwise): prefill instances
and decode instances on disjoint device groups behind one core, so a long prefill never
stalls a decode and each side has its own parallelism and batch.

`DisaggregatedCore` has `EngineCore`'s interface, so `LLM` (and through it the server and
every replay experiment) runs on it unchanged: `LLM(model, prefill_instances=2,
decode_instances=2, prefill_tensor_parallel=2, ...)`. A request goes to the least loaded
prefill instance, which prefills it and samples its first token (PrefillScheduler); the
core then gathers its KV and decode-state row there, moves them to a decode instance's
devices with `jax.device_put` (cbjax/runtime/kv_transfer.py) and inserts them into a slot
(or pages) of that instance (DecodeScheduler), which decodes it to the end. The prefill
side holds the request's slot until a decode instance has room (DistServe's pull).
A request a decode instance preempts for pages is recomputed on a prefill instance; a
transfer that fails finishes its request with an error and frees both sides.

Simulated (`simulate=...`), each instance runs on its own `LaneClock` and the core runs
the earliest lane each round, so instances overlap in simulated time on one shared
clock; a move arrives `kv_transfer_seconds` after its first token (bytes over the
preset's link, or `kv_link`).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import jax

from cbjax.core.builder import build_core
from cbjax.core.engine_args import EngineArgs
from cbjax.core.engine_core import EngineCore
from cbjax.core.engine_queries import EngineQueries
from cbjax.core.lora_admin import LoraAdmin
from cbjax.core.kv_hand_off import KVHandOff
from cbjax.core.step_stats import Load
from cbjax.core.step_stats import StepStats
from cbjax.loading import Model, load_model
from cbjax.request import Request, RequestState
from cbjax.scheduling.roles import PrefillScheduler


class DisaggregatedCore(EngineQueries, LoraAdmin):
    def __init__(self, prefill: list[EngineCore], decode: list[EngineCore], clock: Callable[[], float],
                 simulated: bool = False, transfer_seconds: Callable[[int], float] | None = None,
                 kv_bytes_per_token: int = 0, parallel_step: bool = True):
        self.prefill, self.decode = prefill, decode
        self.cores = prefill + decode
        self.clock = clock
        self.simulated = simulated
        self.kv = KVHandOff(prefill, decode, simulated, transfer_seconds, kv_bytes_per_token)
        self._overlap = [d.executor.overlap for d in decode]
        self.owner: dict[str, EngineCore] = {}  # live request id -> the instance holding it
        self._stalled: set[int] = set()  # cores whose last round ran nothing (ids): run again on a change
        self._idle = False
        many = parallel_step and not simulated and len(self.cores) > 1
        self._pool = ThreadPoolExecutor(len(self.cores)) if many else None

    # The engine, scheduler and page pool it answers about (`EngineQueries`): the first prefill instance's.
    engine = property(lambda self: self.prefill[0].engine)
    scheduler = property(lambda self: self.prefill[0].scheduler)
    pages = property(lambda self: self.prefill[0].pages)
    idle = property(lambda self: self._idle)
    wake_time = None  # continuous instances only: nothing wakes without an arrival
    arrivals_pending: Callable[[], bool] | None = None  # its rounds never run ahead of the front

    transfers = property(lambda self: self.kv.transfers)
    kv_bytes_per_token = property(lambda self: self.kv.kv_bytes_per_token)

    @property
    def predict_len(self):
        return self.prefill[0].predict_len

    @predict_len.setter
    def predict_len(self, predict) -> None:  # the prefill instances admit, in its order
        for c in self.prefill:
            c.predict_len = predict

    @property
    def stats(self) -> StepStats:
        return sum((c.stats for c in self.cores), StepStats())

    @stats.setter
    def stats(self, value: StepStats) -> None:
        for c in self.cores:
            c.stats = StepStats()

    def engine_swapped(self, wrap):
        raise ValueError("the shadowed profiler runs one colocated engine, not a disaggregated front")

    # ------------------------------------------------------------ requests
    def check_request(self, ids: list[int], sampling) -> None:
        if sampling.structured is not None:
            raise ValueError("structured output is not supported with prefill/decode disaggregation")
        self.prefill[0].check_request(ids, sampling)
        self.decode[0].check_request(ids, sampling)  # its pages must hold the request too

    def add(self, request: Request) -> None:
        sibling = self.owner.get(request.fork_of.request_id) if request.fork_of is not None else None
        core = sibling if sibling in self.prefill else min(self.prefill, key=_prefill_load)
        self._give(core, request, request.arrival_time)

    def _give(self, core: EngineCore, request: Request, at: float) -> None:
        waiting = self._waiting(core)
        core.add(request)
        self.owner[request.request_id] = core
        self._wake(core, at if waiting else None)

    def _waiting(self, core: EngineCore) -> bool:
        """Whether `core` sits waiting (nothing to run, or stalled on held requests): on a
        change it starts at the change's time, not at its lane's last one."""
        return id(core) in self._stalled or not _has_work(core)

    def _wake(self, core: EngineCore, at: float | None = None) -> None:
        self._stalled.discard(id(core))
        if self.simulated and at is not None:
            core.clock.catch_up(at)

    def abort(self, request: Request) -> None:
        core = self.owner.pop(request.request_id)
        core.abort(request)
        self._wake(core)

    def has_unfinished(self) -> bool:
        if any(c.has_unfinished() for c in self.cores):
            return True
        self._follow_lanes()
        return False

    def drain(self, draining: bool = True) -> None:
        for c in self.cores:
            c.drain(draining)

    def warmup(self) -> int:
        """Each side's programs (prefill instances: prefill; decode instances: decode) and the
        KV move's gather and insert at every transfer length."""
        count = 0
        for cores, only in ((self.prefill, "prefill"), (self.decode, "decode")):
            for c in cores:
                count += c.engine.warmup(only=only)
        return count + (0 if self.simulated else self.kv.warmup())

    def load(self) -> Load:
        loads = [c.load() for c in self.cores]
        return dataclasses.replace(Load.combine(loads), kv_cache_usage=max(x.kv_cache_usage for x in loads))

    # --------------------------------------------------------------- round
    def run_round(self) -> list[Request]:
        touched: dict[str, Request] = {}
        self._hand_off(touched)
        lanes = [c for c in self.cores if id(c) not in self._stalled and _has_work(c)]
        self._idle = not lanes
        if not lanes:
            self._follow_lanes()
            return list(touched.values())
        # A decode call running ahead (overlap) fixes the slots it computes: while requests wait
        # to move in, decode instances do not run ahead, so the next round can take them.
        waiting_moves = any(p.scheduler.prefilled() for p in self.prefill)
        for d, overlap in zip(self.decode, self._overlap):
            d.executor.overlap = overlap and not waiting_moves
        if self.simulated:  # the earliest lane: instances overlap in simulated time
            lanes = [min(lanes, key=lambda c: c.clock())]
        results = list(self._pool.map(EngineCore.run_round, lanes)) if self._pool else [c.run_round() for c in lanes]
        for core, done in zip(lanes, results):
            if core.idle:
                self._stalled.add(id(core))
            touched.update((r.request_id, r) for r in done)
        self._recompute_evicted()
        self._hand_off(touched)
        for r in touched.values():
            if r.finished:
                self.owner.pop(r.request_id, None)
        self._follow_lanes()
        return list(touched.values())

    def _follow_lanes(self) -> None:
        if self.simulated:
            self.clock.follow([c.clock() for c in self.cores if id(c) not in self._stalled and _has_work(c)],
                              [c.clock() for c in self.cores])

    def _recompute_evicted(self) -> None:
        """Requests a decode instance preempted: recomputed on a prefill instance."""
        for d in self.decode:
            for r in d.scheduler.take_evicted():
                self._give(min(self.prefill, key=_prefill_load), r, d.clock())

    # ------------------------------------------------------------ hand-off
    def _hand_off(self, touched: dict[str, Request]) -> None:
        """Move every prefilled request a decode instance has room for (`KVHandOff`); a failed
        move has ended its request."""
        for p, d, r, ready in self.kv.ready_moves():
            waiting = self._waiting(p), self._waiting(d)
            if self.kv.move(p, d, r):
                self.owner[r.request_id] = d
            else:
                self.owner.pop(r.request_id, None)
                touched[r.request_id] = r
            self._wake(p, ready if waiting[0] else None)
            self._wake(d, ready if waiting[1] else None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def _prefill_load(core: EngineCore) -> int:
    s = core.scheduler
    return 4 * len(s.waiting) + len(s.running)


def _has_work(core: EngineCore) -> bool:
    """Whether a round of `core` would run something (a prefill instance's held requests wait
    for the move, not for a round)."""
    s = core.scheduler
    if isinstance(s, PrefillScheduler):
        return bool(s.waiting) or any(r is not None and r.state == RequestState.PREFILLING for r in s.slots)
    return bool(s.running) or core.in_flight  # a call run ahead is recorded even if all it computed ended


def build_disaggregated(model: str | Model, args: EngineArgs, *, clock: Callable[[], float] = time.perf_counter,
                        simulate=None, devices: Sequence | None = None, mesh=None) -> tuple[Model, DisaggregatedCore]:
    """`args.prefill_instances` prefill and `args.decode_instances` decode instances, each of
    its side's tensor-parallel size, on consecutive groups of `devices` (default
    `jax.devices()`), prefill first."""
    if mesh is not None:
        raise ValueError("a disaggregated front places its instances itself: pass devices, not a mesh")
    tp_p = args.prefill_tensor_parallel or args.tensor_parallel
    tp_d = args.decode_tensor_parallel or args.tensor_parallel
    sides = [("prefill", tp_p)] * args.prefill_instances + [("decode", tp_d)] * args.decode_instances
    groups: list = [None] * len(sides)
    if simulate is None:
        if args.kv_link is not None:
            raise ValueError("kv_link is simulated only: a real move goes over whatever joins the devices")
        devices = list(jax.devices() if devices is None else devices)
        need = sum(tp for _, tp in sides)
        if need > len(devices):
            raise ValueError(f"{args.prefill_instances} prefill x {tp_p} + {args.decode_instances} decode x {tp_d} "
                             f"devices needs {need}, {len(devices)} are available")
        starts = [sum(tp for _, tp in sides[:i]) for i in range(len(sides))]
        groups = [devices[s:s + tp] for s, (_, tp) in zip(starts, sides)]
    elif devices is not None:
        raise ValueError("simulate runs no device: it takes no devices")
    shared = clock
    if simulate is not None:
        from cbjax import simulator

        shared = simulator.SimClock() if clock is time.perf_counter else clock
        if not isinstance(model, Model):
            model = simulator.model_for_simulation(model, dtype=args.dtype)
    elif not isinstance(model, Model):
        model = load_model(model, dtype=args.dtype)
    cores = []
    for (role, tp), group in zip(sides, groups):
        lane = shared if simulate is None else simulator.LaneClock(shared())
        instance = dataclasses.replace(args, prefill_instances=0, tensor_parallel=tp, kv_link=None,
                                       enable_prefix_caching=args.enable_prefix_caching and role == "prefill",
                                       host_kv_cache_bytes=args.host_kv_cache_bytes if role == "prefill" else 0)
        cores.append(build_core(model, instance, clock=lane, simulate=simulate, devices=group, role=role)[1])
    prefill, decode = cores[:args.prefill_instances], cores[args.prefill_instances:]
    transfer_seconds, per_token = None, 0
    if simulate is not None:
        transfer_seconds, per_token = simulator.kv_transfer_cost(decode[0].engine.cost, model.config, args.dtype,
                                                                 min(tp_p, tp_d), args.kv_link)
    return model, DisaggregatedCore(prefill, decode, shared, simulated=simulate is not None,
                                    transfer_seconds=transfer_seconds, kv_bytes_per_token=per_token)
