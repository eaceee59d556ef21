"""Pipeline stages: the layers split over devices, decode in micro-batches.

Stage `s` holds layers `bounds[s]:bounds[s+1]` and their KV cache on `devices[s]`;
the first stage also embeds, the last also holds the head and the slots' decode
state. A call runs stage by stage, the hidden states handed to the next device.
Decode splits the slots into `micro_batches` fixed groups; every (step, group)
goes through all stages. JAX dispatches asynchronously, so while stage 1 works on
group 0, stage 0 already runs group 1: with enough groups per round (and
`decode_steps` > 1, since the host syncs once per round) every stage stays busy,
and the only bubbles are the fill and drain of each round and the prefills, which
run un-split (source note 004: keep the pipeline full with a dynamic batch).

Every stage call is logged (`call_log`: rounds of `StageCall`s in dispatch order), so
`bubble_fraction` can replay the schedule against a cost per call and say how long
each device sat idle; on a CPU the host devices share the cores, so the wall clock
cannot show the overlap itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from typing_extensions import override

from cbjax import checks
from cbjax.runtime.traced.device_state import TRACE_COUNTS, SlotState
from cbjax.runtime import packing
from cbjax.runtime.traced import programs
from cbjax.runtime.engine import Engine
from cbjax.runtime.engine_choices import kv_dtype
from cbjax.runtime.packed import QLEN, START, resolve
from cbjax.runtime.traced.step import run_layers, sample_rows
from cbjax.models.kv_cache import SlotCache
from cbjax.models.ops import XLA
from cbjax.scheduling.plan import Row


@dataclasses.dataclass(frozen=True)
class StageCall:
    stage: int
    chain: tuple  # calls of one chain run in order through the stages: ("prefill", i) or ("decode", group)
    kind: str  # "prefill" or "decode"
    rows: int
    tokens: int  # per row
    kv_len: int


def stage_bounds(num_layers: int, stages: int) -> list[int]:
    """Layer boundaries: stage s runs layers bounds[s]:bounds[s+1], the first stages one
    layer more when they do not divide evenly."""
    sizes = [num_layers // stages + (s < num_layers % stages) for s in range(stages)]
    return [0] + np.cumsum(sizes).tolist()


@jax.jit
def _resolve(state, lengths, flat, ints):
    """The batch with the device's decode inputs and positions, once for every stage."""
    return resolve(state, lengths, flat, ints)


@functools.partial(jax.jit, static_argnames=("config", "first_layer", "embed", "history_block"),
                   donate_argnames="cache")
def _stage(params, cache, batch, x, *, config, first_layer, embed, history_block):
    """A stage before the last: its layers over the batch, the hidden states handed on."""
    TRACE_COUNTS[("pipeline-stage", config, batch.inputs.shape[0], first_layer)] += 1
    return run_layers(params, config, cache, batch, hidden=x, history_block=history_block, first_layer=first_layer,
                      embed=embed, head=False)


@functools.partial(jax.jit, static_argnames=("config", "max_len", "first_layer", "history_block", "platform"),
                   donate_argnames=("cache", "state"))
def _last_stage(params, cache, state, batch, x, flat, ints, floats, *, config, max_len, first_layer, history_block,
                platform):
    """The last stage: its layers, the head, and the step's sampling and state update (the
    one step's, step.sample_rows, traced for `platform`). Returns `[R, 2]` (token or -1, done)."""
    TRACE_COUNTS[("pipeline-last", config, batch.inputs.shape[0], first_layer)] += 1
    logits, cache = run_layers(params, config, cache, batch, hidden=x, history_block=history_block,
                               first_layer=first_layer, embed=False)
    out, _, state = sample_rows(state, logits, batch, flat, ints, floats, max_len=max_len, max_logprobs=0,
                                ops=XLA.on(platform))
    return out, cache, state


class PipelineEngine(Engine):
    """`Engine` with its layers over `stages` devices (slot cache, prefill-then-decode rounds,
    reference attention)."""

    kind = "pipeline"
    reads_block_tables = False
    can_run_ahead = False  # its decode hands activations between stages through the host loop
    supports_structured_output = False  # its last stage samples without masks
    takes_sampler_variants = False  # its last stage samples with every part of sampling
    scores_prompts = False  # prompt logprobs by a forward of their own (`Engine.prompt_scorer`)

    def __init__(self, model, config, stages: int = 2, micro_batches: int = 1, devices=None):
        self.stages = checks.integer("pipeline_stages", stages, 2)
        self.micro_batches = checks.integer("micro_batches", micro_batches, 1)
        if config.kv_cache != "slots" or config.merge_mode != "prefill_first" or config.attention == "pallas":
            raise ValueError("pipeline stages run the slot cache with merge_mode='prefill_first' and reference "
                             "attention")
        config = dataclasses.replace(config, attention="reference")  # what its stages run, "auto" included
        if config.num_slots % self.micro_batches:
            raise ValueError(f"micro_batches={micro_batches} must divide num_slots={config.num_slots}")
        if model.config.num_layers < self.stages:
            raise ValueError(f"{self.stages} pipeline stages need at least as many layers "
                             f"(the model has {model.config.num_layers})")
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < self.stages:
            raise ValueError(f"{self.stages} pipeline stages need {self.stages} devices, {len(devices)} are available")
        self.devices = devices[:self.stages]
        self.bounds = stage_bounds(model.config.num_layers, self.stages)
        super().__init__(model, config)
        self.max_logprobs = 0  # its last stage's decode program computes none
        self.stage_params = [jax.device_put(self._params_of(s), d) for s, d in enumerate(self.devices)]
        self.groups = np.arange(config.num_slots).reshape(self.micro_batches, -1).tolist()  # slots per micro-batch

    num_devices = property(lambda self: self.stages)

    def _params_of(self, s: int) -> dict:
        p, lo, hi = self.params, self.bounds[s], self.bounds[s + 1]
        out = {"layers": p["layers"][lo:hi]}
        first, last = s == 0, s == self.stages - 1
        for name in p:
            if name == "layers":
                continue
            embedding = name in ("embed", "pos_embed")
            if (first and embedding) or (last and (name in ("final_norm", "lm_head")
                                                    or (name == "embed" and self.model.config.tie_embeddings))):
                out[name] = p[name]
        return out

    def _stage_config(self, s: int):
        """The model config with only stage s's layers: the shape of its KV cache."""
        return dataclasses.replace(self.model.config, num_layers=self.bounds[s + 1] - self.bounds[s],
                                   sliding_windows=self.model.config.sliding_windows[self.bounds[s]:self.bounds[s + 1]])

    @override
    def reset(self) -> None:
        dtype = kv_dtype(self.model, self.config)
        c = self.config
        self.caches = [jax.device_put(SlotCache.init(self._stage_config(s), c.num_slots, self.max_len, dtype), d)
                       for s, d in enumerate(self.devices)]
        self.state = jax.device_put(SlotState.init(self.num_slots, c.max_stop_tokens, c.max_logit_bias,
                                                   self.model.config.vocab_size), self.devices[-1])
        self._tables = None
        self.call_log: list[list[StageCall]] = []

    @property
    @override
    def cache(self):  # the last stage's (its lengths are every stage's)
        return self.caches[-1]

    @override
    def copy_kv(self, copies) -> None:
        src, dst = packing.copy_pairs(copies)
        for s, d in enumerate(self.devices):  # each stage holds its own layers of every slot
            self.caches[s] = programs.copy_kv(self.caches[s], jax.device_put(src, d), jax.device_put(dst, d))

    def _new_round(self) -> None:
        self.call_log.append([])

    def _log(self, stage, chain, kind, rows, tokens, kv_len) -> None:
        if not self.call_log:
            self._new_round()
        self.call_log[-1].append(StageCall(stage, chain, kind, rows, tokens, kv_len))

    @override
    def run(self, rows: list[Row], steps: int = 1) -> list:
        """As `Engine.run`. Prompt rows go through the stages un-split; decode rows are run for
        every slot (whichever `rows` name: the micro-batches are fixed), micro-batch by
        micro-batch, each step's groups dispatched back to back so the stages overlap."""
        if steps > 1 and not all(r.is_decode for r in rows):
            raise ValueError("several steps in one call run decode rows only")
        if rows and all(r.is_decode for r in rows):
            if not self.call_log or any(c.kind == "decode" for c in self.call_log[-1]):
                self._new_round()  # a round is its prompt calls, then its decode calls
            return [self._decode(rows, steps)]
        self._new_round()
        return super().run(rows, steps)

    @override
    def _dispatch(self, packed, steps: int, sampler=None, verify: int = 0, prompt_k: int = 0) -> jax.Array:
        """A call of prompt rows through the stages (logged with the longest row's end as its
        attended length); `sampler` is always ALL here (`takes_sampler_variants`), and no row
        scores its prompt (`scores_prompts`)."""
        ints = packed[1]
        attended = int((ints[:, START] + ints[:, QLEN]).max())
        return self._through_stages(packed, ("prefill", len(self.call_log[-1])), "prefill", attended)[None]

    def _decode(self, rows: list[Row], steps: int):
        longest = max(r.request.num_tokens if r.request is not None else r.start + 1 for r in rows)
        per_group = self.num_slots // self.micro_batches
        outs = []
        for i in range(steps):
            step_out = []
            for g, group in enumerate(self.groups):
                group_rows = [Row(slot, [], 0) for slot in group]
                packed = self._pack(group_rows, per_group)
                step_out.append(self._through_stages(packed, ("decode", g), "decode", longest + i))
            outs.append(jnp.concatenate(step_out))
        # The results come in slot order: the round's row of slot s is at s.
        members = [-1] * self.num_slots
        for i, r in enumerate(rows):
            members[r.slot] = i
        return jnp.stack(outs), members

    def _through_stages(self, packed, chain, kind: str, attended: int) -> jax.Array:
        last = self.stages - 1
        flat, ints, floats = (jax.device_put(a, self.devices[last]) for a in packed)
        batch = _resolve(self.state, self.caches[last].lengths, flat, ints)
        rows, tokens = ints.shape[0], flat.shape[1]
        block = self.history_block()
        x = None
        for s in range(last):
            x, self.caches[s] = _stage(self.stage_params[s], self.caches[s], jax.device_put(batch, self.devices[s]),
                                       None if x is None else jax.device_put(x, self.devices[s]),
                                       config=self.model.config, first_layer=self.bounds[s], embed=s == 0,
                                       history_block=block)
            self._log(s, chain, kind, rows, tokens // rows, attended)
        out, self.caches[last], self.state = _last_stage(
            self.stage_params[last], self.caches[last], self.state, batch, jax.device_put(x, self.devices[last]),
            flat, ints, floats, config=self.model.config, max_len=self.max_len, first_layer=self.bounds[last],
            history_block=block, platform=self.platform)
        self._log(last, chain, kind, rows, tokens // rows, attended)
        return out

    @override
    def programs(self, only: str | None = None) -> list[tuple]:
        """Each token bucket's pass through the stages, and the decode micro-batch's."""
        per_group = self.num_slots // self.micro_batches
        progs = [("stages", n, 1) for n in self.token_buckets()] if only != "decode" else []
        return progs + ([("stages", per_group, 1)] if ("stages", per_group, 1) not in progs else [])

    @override
    def compile_programs(self, progs: list[tuple], meanwhile: Callable[[], None] | None = None) -> None:
        """A padding pass per program, in turn (after `meanwhile`): its programs are per stage and
        device, and each pass updates the stages' caches."""
        if meanwhile is not None:
            meanwhile()
        for _, num_tokens, _ in progs:
            padding = self._pack([], num_tokens)
            jax.block_until_ready(self._through_stages(padding, ("warmup", num_tokens), "prefill", 0))


def bubble_fraction(rounds: list[list[StageCall]], seconds, num_stages: int) -> dict:
    """Replay a logged schedule: each device runs its calls in dispatch order, a call waits
    for its chain's previous call (the stage before, or for a decode group the last stage
    of its previous step), a round's decodes wait for its prefills (their first tokens),
    and a round starts when the previous one has finished (the host's sync). `seconds`
    prices a call. Returns busy and total time and the idle ("bubble") fraction."""
    busy = [0.0] * num_stages
    clock = 0.0
    for calls in rounds:
        free = [clock] * num_stages
        ready: dict[tuple, float] = {}
        prefills_done = clock
        for c in calls:
            dep = ready.get(c.chain, clock)
            if c.kind == "decode":
                dep = max(dep, prefills_done)
            begin = max(free[c.stage], dep)
            cost = seconds(c)
            free[c.stage] = ready[c.chain] = begin + cost
            busy[c.stage] += cost
            if c.kind == "prefill" and c.stage == num_stages - 1:
                prefills_done = max(prefills_done, begin + cost)
        clock = max(free)
    total = clock * num_stages
    return {"makespan_s": clock, "busy_s": busy, "bubble_fraction": 1 - sum(busy) / total if total else 0.0}
