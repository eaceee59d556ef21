"""Calibration: time the rounds of a real engine and fit a cost model to them.

`ShadowedEngine` forwards every call to the real engine and to a `SimulatedEngine`
whose cost model only records the calls, so each measured round comes with exactly
the calls the simulator would charge for it (and the shadow's answers are checked
against the device's: the simulator's state mirror is tested on every profiled call).
"""

from __future__ import annotations

import contextlib
import time

import jax
import numpy as np

from cbjax.runtime.packing import split_logprobs
from cbjax.simulator.cost_model import CalibratedCost, Call
from cbjax.simulator.sim_engine import SimClock, SimulatedEngine


class _Recorder:
    def __init__(self):
        self.calls: list[Call] = []

    def seconds(self, call: Call) -> float:
        self.calls.append(call)
        return 0.0


class ShadowedEngine:
    can_run_ahead = False  # each call is compared with the simulator's as it is made
    def __init__(self, real, check: bool = True):
        self.real = real
        self.check = check
        self.recorder = _Recorder()
        self.shadow = SimulatedEngine(real.model, real.config, self.recorder, SimClock(), real.platform)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _compare(self, what: str, device, shadow) -> None:
        if self.check and not np.array_equal(np.asarray(device), np.asarray(shadow)):
            raise AssertionError(f"the simulator's {what} disagrees with the device's")

    def run(self, rows, steps: int = 1):
        shadow = self.shadow.run(rows, steps)
        calls = self.real.run(rows, steps)
        for (device, _), (sim, _) in zip(calls, shadow):
            device = _host(device)  # the tokens differ (the simulator's are fillers), not who sampled or finished
            self._compare("step activity and done flags", np.stack([device[..., 0] >= 0, device[..., 1]]),
                          np.stack([sim[..., 0] >= 0, sim[..., 1]]))
        return calls

    def deactivate(self, slot: int) -> None:
        self.shadow.deactivate(slot)
        self.real.deactivate(slot)

    def move_kv(self, ops) -> None:
        self.shadow.move_kv(ops)
        self.real.move_kv(ops)

    def take_calls(self) -> list[Call]:
        calls, self.recorder.calls = self.recorder.calls, []
        return calls


def profile_rounds(llm, workload, check: bool = True) -> list[tuple[list[Call], float]]:
    """Run `workload` (`(prompt, sampling)` pairs, all queued at once) on `llm`'s real,
    warmed-up engine; returns each round's calls and wall seconds."""
    core = llm.core
    with core.engine_swapped(lambda engine: ShadowedEngine(engine, check)) as shadowed:
        for prompt, sampling in workload:
            llm.add_request(prompt, sampling)
        core.drain(True)
        rounds, finished = [], []
        try:
            while core.has_unfinished():
                t0 = time.perf_counter()
                touched = core.run_round()
                seconds = time.perf_counter() - t0
                finished += [r for r in touched if r.finished]
                calls = shadowed.take_calls()
                if calls:
                    rounds.append((calls, seconds))
        finally:
            core.drain(False)
    llm.outputs_of(finished)
    return rounds


@contextlib.contextmanager
def engine_lent(llm):
    """The engine behind `llm`'s core, lent for a study of the engine itself through the core's
    contract (`Core.engine_swapped`): no round runs on it meanwhile but the study's own."""
    with llm.core.engine_swapped(lambda engine: engine) as engine:
        yield engine


def measure_host_copy(llm, num_pages: int = 64, repeats: int = 5) -> float:
    """Bytes per second `llm`'s paged engine moves between its cache and the host tier:
    `num_pages` pages out and back in (one batch each way), the best of `repeats` round trips."""
    with engine_lent(llm) as engine:
        return _host_copy(engine, num_pages, repeats)


def timed_swap(llm, request_id: str) -> tuple[float, float]:
    """Seconds to swap a running request's cached KV out to the host tier and back into its
    slot (`llm` paged, with a host tier), each waited for on the device."""
    from cbjax.scheduling.host_tier import KVOp

    snapshot = llm.snapshot()
    slot, pages = snapshot.slots.index(request_id), snapshot.page_tables[request_id]
    length = llm.requests[request_id].num_tokens - 1
    with engine_lent(llm) as engine:
        t0 = time.perf_counter()
        engine.move_kv([KVOp("seq_out", "probe", slot=slot, length=length, pages=pages)])
        jax.block_until_ready(engine.host_kv.sequences["probe"])
        t1 = time.perf_counter()
        engine.move_kv([KVOp("seq_in", "probe", slot=slot, pages=pages)])
        jax.block_until_ready(engine.cache)
        return t1 - t0, time.perf_counter() - t1


def _host_copy(engine, num_pages: int, repeats: int) -> float:
    from cbjax.scheduling.host_tier import KVOp

    pages = min(num_pages, engine.config.num_pages)
    out = [KVOp("page_out", ("probe", i), page=i) for i in range(pages)]
    back = [KVOp("page_in", ("probe", i), page=i) for i in range(pages)]
    best = float("inf")
    for _ in range(repeats + 1):  # the first compiles
        t0 = time.perf_counter()
        engine.move_kv(out)
        engine.move_kv(back)
        jax.block_until_ready(engine.cache)
        best = min(best, time.perf_counter() - t0)
    page_bytes = sum(layer[:, 0].nbytes for layer in (*engine.cache.k, *engine.cache.v))
    return 2 * pages * page_bytes / best


@contextlib.contextmanager
def recorded_rounds(llm, check: bool = False):
    """Record every round `llm` runs inside the block, its calls (as the simulator would charge
    them) with its wall seconds, into the list it yields: a calibration taken from a real run
    (a replay on the wall clock) rather than from a profile. The engine is shadowed meanwhile,
    so no decode call runs ahead (`ShadowedEngine.can_run_ahead`)."""
    core = llm.core
    rounds: list[tuple[list[Call], float]] = []
    run_round = core.run_round
    with core.engine_swapped(lambda engine: ShadowedEngine(engine, check)) as shadowed:
        def timed_round():
            t0 = time.perf_counter()
            touched = run_round()
            seconds = time.perf_counter() - t0
            calls = shadowed.take_calls()
            if calls:
                rounds.append((calls, seconds))
            return touched

        core.run_round = timed_round
        try:
            yield rounds
        finally:
            del core.run_round


def calibrate(rounds: list[tuple[list[Call], float]], info: dict | None = None) -> CalibratedCost:
    return CalibratedCost.fit(rounds, info)


def _host(out) -> np.ndarray:
    """A device program's token result on the host (its logprob columns left out)."""
    return np.asarray(jax.device_get(split_logprobs(out)[0]))


class _Free:
    """A cost model that charges nothing: what is left of a round's wall time is the host's."""

    def seconds(self, call) -> float:
        return 0.0


def measure_host_costs(shape: str = "llama3-8b", slot_counts=(8, 32, 128), requests: int = 256,
                       seed: int = 0) -> dict:
    """This engine's host work per round on this machine (scheduler, bookkeeping, outputs),
    timed on the simulator with free device calls: the least-squares line seconds = per
    call + per request x requests in the round, over rounds of several batch sizes. These
    are the `call_overhead_s` / `request_overhead_s` to add to an accelerator preset to
    simulate this engine rather than the engines the presets were fitted on."""
    from cbjax import LLM
    from cbjax.workload import LengthDist, synthetic

    rows, seconds = [], []
    for slots in slot_counts:
        llm = LLM(shape, simulate=_Free(), num_slots=slots, max_seq_len=512, dtype="bfloat16", kv_cache="paged",
                  attention="pallas", page_size=16, num_pages=slots * 32)
        work = synthetic(requests, prompt_len=LengthDist("uniform", low=16, high=128),
                         output_len=LengthDist("uniform", low=16, high=256), vocab_size=1000, seed=seed)
        for w in work:
            llm.add_request(w.prompt, w.sampling)
        core = llm.core
        while core.has_unfinished():
            running = core.load().running
            t0 = time.perf_counter()
            core.run_round()
            seconds.append(time.perf_counter() - t0)
            rows.append(running)
    design = np.stack([np.ones(len(rows)), np.asarray(rows, float)], axis=1)
    (per_call, per_request), *_ = np.linalg.lstsq(design, np.asarray(seconds), rcond=None)
    return {"call_overhead_s": float(per_call), "request_overhead_s": float(per_request), "rounds": len(rows),
            "median_round_s": float(np.median(seconds))}
