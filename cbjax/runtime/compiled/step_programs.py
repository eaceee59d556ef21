"""The compiled step programs an engine runs, and which one each call runs: keyed by the
arguments' shapes, the steps a call runs and the sampler variant (`request.Sampler`);
compiled (or read from disk, runtime/compiled/executables.py) at first use, many at once at warm-up.

Sampler variants: the host, which packs every row's sampling parameters, knows which parts of
sampling a call's rows need (`request.Sampler`). A decode row named by its slot alone (the
overlap's calls) needs what its slot's request needs: the host keeps that per slot, set by the
row that ends the request's prompt, and `ALL` for a slot whose state came from elsewhere (a
swap-in, a disaggregated move) until a prompt row tells it otherwise.

On a GPU a branch computes both sides (`sampling.skip_unless`), so each call runs the smallest
variant that covers its rows: `warmup` compiles `ALL` for every bucket (any request runs at
once), then the all-greedy programs in the background; any other variant is compiled in the
background the first time a call needs it, and `ALL` serves that call and every later one until
it is ready. At most 16 variants a bucket, and only those a workload reaches.

On a CPU or TPU a branch skips its work at run time, so a variant saves only its compile (a
greedy program traces, lowers and compiles in half the time of `ALL`'s: docs/engine.md). An
engine that has not warmed up runs the greedy programs while every call it has run was greedy,
and `ALL` from the first call that needs anything more (at most two programs a bucket);
warm-up compiles `ALL` for every bucket and the engine runs only those from then on, as before.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import jax

from cbjax.runtime.compiled import executables

from cbjax.runtime.traced import step
from cbjax.request import ALL, GREEDY, Sampler
from cbjax.runtime.traced.sampling import SELECTING_PLATFORMS
from cbjax.runtime.traced.step import ragged_step


def abstract(args):
    """`args` with every device array as its shape, dtype and sharding: a background compile
    must not hold buffers that the step donates meanwhile."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                        if isinstance(a, jax.Array) else a, args)


class SamplerVariants:
    def __init__(self, num_slots: int, platform: str, allowed: bool = True):
        """`allowed`: whether the engine's step takes a sampler variant at all (a pipeline's
        last stage samples with every part)."""
        self.specializes = allowed and platform in SELECTING_PLATFORMS
        # Where branches skip work: GREEDY until a call needs more (or warm-up compiled ALL), then ALL.
        self._greedy_only = allowed and not self.specializes
        self._slots = [int(ALL)] * num_slots  # what each slot's request needs (bits of Sampler)

    @property
    def ahead(self) -> tuple[Sampler, ...]:
        """The variants warm-up prepares: first `ALL` (every call can run it), then in the background the rest."""
        return (ALL, GREEDY) if self.specializes else (ALL,)

    def reset(self) -> None:
        """Every slot empty: nothing samples from them until a prompt row ends there."""
        self._slots = [0] * len(self._slots)

    def for_rows(self, rows) -> Sampler:
        """The variant a call of `rows` runs: on a GPU the smallest that covers them; elsewhere
        `GREEDY` while every call so far was greedy, else `ALL` (after warm-up, or where the
        engine takes no variants: always `ALL`)."""
        if not (self.specializes or self._greedy_only):
            return ALL
        need, table = 0, self._slots
        for row in rows:
            if row.is_last:
                table[row.slot] = Sampler.of(row.sampling)
            need |= table[row.slot]
        if self.specializes:
            return Sampler(need)
        self._greedy_only = not need
        return GREEDY if self._greedy_only else ALL

    def warmed_up(self) -> None:
        """Every bucket's `ALL` program is compiled: where branches skip work, run only those."""
        self._greedy_only = False

    def slot_replaced(self, slot: int, need: int = ALL) -> None:
        """Slot `slot`'s decode state was written whole (a sequence moved in): `need`, what its
        request needs (`of_slot` where it left, when the host kept it), else any variant."""
        self._slots[slot] = int(need)

    def of_slot(self, slot: int) -> int:
        """What slot `slot`'s request needs (bits of Sampler), kept for it to move back in with."""
        return self._slots[slot]


def program_key(args: tuple, static: dict) -> tuple:
    """(the packed arrays' shapes, steps, verify positions, prompt scores' top k, sampler): what
    tells one engine's step programs apart."""
    return (tuple(getattr(a, "shape", None) for a in args[3:]), static["steps"], static["verify"],
            static.get("prompt_k", 0), static["sampler"])


class StepPrograms:
    def __init__(self):
        # (the packed arrays' shapes, steps, verify, sampler) -> compiled program (the engine's hot path reads it)
        self.ready: dict = {}
        self._compiling: dict = {}  # key -> Future of a background compile
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def keys(self) -> list[tuple]:
        """(argument shapes, steps, verify, sampler) of every program ready."""
        return list(self.ready)

    def get(self, args: tuple, static: dict, wait: bool = False):
        """The program for these arguments (params, cache, state, then the packed arrays). A
        sampler variant narrower than `ALL` not compiled yet is compiled in the background
        (`wait`: now) and `ALL`'s program serves meanwhile; a program compiling in the
        background already is waited for rather than compiled twice."""
        key = program_key(args, static)
        program = self.ready.get(key)
        if program is None and static["sampler"] != ALL and not wait:
            self.compile_later(args, static)
            return self.get(args, {**static, "sampler": ALL})
        if program is None and key in self._compiling:
            self._compiling[key].result()
            return self.ready[key]
        if program is None:
            program = self.ready[key] = executables.compiled(ragged_step, step.JIT_OPTIONS, args, static)
        return program

    def forget(self) -> None:
        """Drop the programs compiled so far (a kernel launch chosen since makes them stale);
        waits for those compiling in the background first."""
        self.wait()
        with self._lock:
            self.ready.clear()
            self._compiling.clear()

    def compile_later(self, args: tuple, static: dict) -> bool:
        """Compile the program of these arguments on a background thread, once (shapes only are
        kept: the step donates its buffers meanwhile). False if it is ready or on its way."""
        key = program_key(args, static)
        with self._lock:
            if key in self._compiling or key in self.ready:
                return False
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cbjax-compile")
            shapes = abstract(args)

            def run():
                self.ready[key] = executables.compiled(ragged_step, step.JIT_OPTIONS, shapes, static)

            self._compiling[key] = self._pool.submit(run)
            return True

    def wait(self) -> int:
        """Wait for every background compile (a benchmark's timing starts after); the number done."""
        with self._lock:
            futures = list(self._compiling.values())
        for f in futures:
            f.result()
        return len(futures)

    def start_compiles(self, calls: list[tuple[tuple, dict]]) -> list[concurrent.futures.Future]:
        """Start compiling the program of each `(args, static)` on a thread per core (XLA releases
        the GIL), in order; a future per call. No gain on XLA:CPU's compile alone, whose compiler
        already splits one program over the cores (docs/code_measurements.md), but the tracing
        of one overlaps another's compile or persistent-cache read, and the caller's own work
        (warm-up's small programs, the first runs) fills the idle cores. Shapes only are held:
        the caller's steps donate the buffers meanwhile."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        pool = concurrent.futures.ThreadPoolExecutor(max(min(len(calls), cores), 1), thread_name_prefix="cbjax-warm")
        futures = [pool.submit(self.get, abstract(args), static, True) for args, static in calls]
        pool.shutdown(wait=False)
        return futures


def reachable_programs(buckets: list[int], num_slots: int, decode_steps: int, only: str | None = None,
                       verify_positions: int = 0, mixed: bool = False) -> list[tuple]:
    """Every step program a workload can reach: ("step", tokens bucket, steps), those of
    prompt rows (one step) and of decode rows (`decode_steps`, up to the bucket of every slot
    decoding); with speculation (`verify_positions`), ("verify", tokens bucket, 1), those of
    calls with verify rows (beside prompt rows when `mixed`, else up to every slot verifying).
    `only`: "decode" or "prefill", one kind alone."""
    most_rows = 1 << (num_slots - 1).bit_length()
    decode_top = next((n for n in buckets if n >= most_rows), buckets[-1])
    progs = []
    if only != "decode":
        progs += [("step", n, 1) for n in buckets]
    if only != "prefill":
        progs += [("step", n, decode_steps) for n in buckets
                  if n <= decode_top and ("step", n, decode_steps) not in progs]
    if verify_positions and only != "prefill":
        verify_top = next((n for n in buckets if n >= num_slots * verify_positions), buckets[-1])
        progs += [("verify", n, 1) for n in buckets if mixed or n <= verify_top]
    return progs
