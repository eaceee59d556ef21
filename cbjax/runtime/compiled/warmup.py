"""Compiling ahead: every program a configuration can reach, compiled (and run once on
padding) before the first request, so that timings and latencies exclude compilation."""

from __future__ import annotations

import jax
import numpy as np

from cbjax import grammar
from cbjax.runtime.packing import row_bucket
from cbjax.scheduling.plan import Row


def warm_up(engine, only: str | None = None) -> int:
    """Compile every program of `engine` up front; leaves it empty. Returns the number of model
    programs. `only`: as `Engine.programs`."""
    progs = engine.programs(only)
    engine.compile_programs(progs, meanwhile=lambda: _warm_small_programs(engine, only))
    if not progs:
        _warm_small_programs(engine, only)
    engine.samplers.warmed_up()
    for sampler in engine.samplers.ahead[1:]:  # narrower variants: in the background
        for _, num_tokens, steps in (p for p in progs if p[0] == "step"):
            engine.compile_program(num_tokens, steps, sampler)
    engine.reset()
    return len(progs)


def _warm_small_programs(engine, only: str | None) -> None:
    """The engine's programs beside the steps, compiled by running them once (while the steps
    compile on other threads). Forks of n > 1 samples (any configuration) and prefix hits start
    past position 0: their KV copies and the penalties' history of the tokens before them."""
    for bucket in engine.buckets if only != "decode" else ():
        engine.record_histories([Row(0, [], 0, history=[0] * bucket)])
    for size in (1 << i for i in range((engine.num_slots - 1).bit_length() + 1)) if only != "decode" else ():
        engine.copy_kv([(0, 0)] * size)
    engine.deactivate(0)  # abort and preemption
    if engine.lora is not None:  # loading a LoRA adapter into the pool
        engine.lora.warmup()


def warm_structured_output(engine, background: bool = False) -> int:
    """Compile (and run once on padding) the masked variant of every one-step program: the
    programs a structured-output request runs, which `warmup` leaves out. Without them the first
    constrained request compiles one on the engine's thread (seconds on a CPU), stalling every
    stream. `background`: compile them on a background thread instead (the
    server's start then does not wait for them; a constrained request that comes first waits for
    its own program only, and on a CPU its first run pays XLA's set-up of the program's
    matmuls, which the padding run would have paid). Returns the number of programs."""
    words = grammar.mask_words(engine.model.config.vocab_size)
    progs = [(n, steps) for kind, n, steps in engine.programs() if steps == 1 and kind == "step"]
    out = None
    for num_tokens, steps in progs:
        masks = np.full((row_bucket(num_tokens, engine.num_slots), words), -1, np.int32)
        args, static = engine.padding_arguments(num_tokens, steps, masks=masks)
        if background:
            engine.compiled.compile_later(args, static)
        else:
            out = engine.run_program(args, static)
    if not background:
        jax.block_until_ready(out)
        engine.reset()
    return len(progs)
