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

import jax
import jax.numpy as jnp
import numpy as np

from cbjax import checks
from cbjax.runtime.device_state import TRACE_COUNTS, SlotState, is_done
from cbjax.runtime import programs, row_packing
from cbjax.runtime.engine import Engine
from cbjax.models.kv_cache import SlotCache
from cbjax.models import forward
from cbjax.runtime.sampling import count_sampled, sample_next


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


@functools.partial(jax.jit, static_argnames=("config", "kv_len", "first_layer", "embed"), donate_argnames="cache")
def _prefill_stage(params, cache, x, ints, *, config, kv_len, first_layer, embed):
    """A stage before the last: write the chunks' keys and values, hand on the hidden states."""
    TRACE_COUNTS[("pipeline-prefill", config, x.shape[:2], kv_len, first_layer)] += 1
    return forward(params, config, cache, x, ints[:, programs.START], num_valid=ints[:, programs.LENGTH],
                   slot_ids=ints[:, programs.SLOT], kv_len=kv_len, embed=embed, head=False, first_layer=first_layer)


@functools.partial(jax.jit, static_argnames=("config", "kv_len", "first_layer", "embed"), donate_argnames="cache")
def _decode_stage(params, cache, x, active, slots, *, config, kv_len, first_layer, embed):
    """A stage before the last for one decode micro-batch (`slots`)."""
    TRACE_COUNTS[("pipeline-decode", config, slots.shape[0], kv_len, first_layer)] += 1
    return forward(params, config, cache, x[:, None] if embed else x, cache.lengths[slots],
                   num_valid=active.astype(jnp.int32), slot_ids=slots, kv_len=kv_len, embed=embed, head=False,
                   first_layer=first_layer)


@functools.partial(jax.jit, static_argnames=("config", "max_len", "kv_len", "first_layer"),
                   donate_argnames=("cache", "state"))
def _decode_last(params, cache, state, x, slots, *, config, max_len, kv_len, first_layer):
    """The last stage of a decode micro-batch: its layers, the head, sampling, and the slots'
    state (as one step of `programs.decode_steps`, for rows `slots`). Returns tokens or -1."""
    TRACE_COUNTS[("pipeline-decode-last", config, slots.shape[0], kv_len, first_layer)] += 1
    rows = state.rows(slots)
    active = rows.active
    logits, cache = forward(params, config, cache, x, cache.lengths[slots], num_valid=active.astype(jnp.int32),
                            slot_ids=slots, kv_len=kv_len, logits_index=jnp.zeros_like(slots), embed=False,
                            first_layer=first_layer)
    token, _ = sample_next(logits, rows, rows.num_generated, 0)
    generated = rows.num_generated + active
    done = active & is_done(token, rows.stop_ids, generated, rows.max_tokens, cache.lengths[slots] + 1, max_len)
    state = state.set_rows(slots, tokens=jnp.where(active, token, rows.tokens), active=active & ~done,
                           num_generated=generated, counts=count_sampled(rows.counts, token, active))
    return jnp.where(active, token, -1), cache, state


@jax.jit
def _decode_inputs(state, slots):
    return state.tokens[slots], state.active[slots]


class PipelineEngine(Engine):
    """`Engine` with its layers over `stages` devices (slot cache, prefill-then-decode rounds,
    reference attention)."""

    reads_block_tables = False
    can_run_ahead = False  # its decode hands activations between stages through the host loop

    def __init__(self, model, config, stages: int = 2, micro_batches: int = 1, devices=None):
        self.stages = checks.integer("pipeline_stages", stages, 2)
        self.micro_batches = checks.integer("micro_batches", micro_batches, 1)
        if config.kv_cache != "slots" or config.merge_mode != "prefill_first" or config.attention != "reference":
            raise ValueError("pipeline stages run the slot cache with merge_mode='prefill_first' and reference "
                             "attention")
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
        groups = np.arange(config.num_slots, dtype=np.int32).reshape(self.micro_batches, -1)
        self.groups = [[jax.device_put(g, d) for d in self.devices] for g in groups]

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

    def reset(self) -> None:
        dtype = jax.tree.leaves(self.params)[0].dtype
        c = self.config
        self.caches = [jax.device_put(SlotCache.init(self._stage_config(s), c.num_slots, self.max_len, dtype), d)
                       for s, d in enumerate(self.devices)]
        self.state = jax.device_put(SlotState.init(self.num_slots, c.max_stop_tokens, c.max_logit_bias,
                                                   self.model.config.vocab_size), self.devices[-1])
        self._tables = None
        self.call_log: list[list[StageCall]] = []

    @property
    def cache(self):  # the last stage's (its lengths are every stage's)
        return self.caches[-1]

    def copy_kv(self, copies) -> None:
        src, dst = row_packing.copy_pairs(copies)
        for s, d in enumerate(self.devices):  # each stage holds its own layers of every slot
            self.caches[s] = programs.copy_kv(self.caches[s], jax.device_put(src, d), jax.device_put(dst, d))

    def _new_round(self) -> None:
        self.call_log.append([])

    def _log(self, stage, chain, kind, rows, tokens, kv_len) -> None:
        if not self.call_log:
            self._new_round()
        self.call_log[-1].append(StageCall(stage, chain, kind, rows, tokens, kv_len))

    def prefill(self, chunks):
        self._new_round()  # the LLM starts every prefill-then-decode round with a prefill call
        return super().prefill(chunks)

    def _prefill_call(self, chunks, bucket: int, kv_len: int) -> jax.Array:
        tokens, ints, floats = self._pack_prefill(chunks, bucket)
        rows = tokens.shape[0]
        chain = ("prefill", len(self.call_log[-1]) if self.call_log else 0)
        x = tokens
        for s in range(self.stages - 1):
            x = jax.device_put(x, self.devices[s])
            x, self.caches[s] = _prefill_stage(self.stage_params[s], self.caches[s], x, ints,
                                               config=self.model.config, kv_len=kv_len,
                                               first_layer=self.bounds[s], embed=s == 0)
            self._log(s, chain, "prefill", rows, bucket, kv_len)
        last = self.stages - 1
        out, self.caches[last], self.state = programs.prefill_step(
            self.stage_params[last], self.caches[last], self.state, jax.device_put(tokens, self.devices[last]), ints,
            floats, jax.device_put(x, self.devices[last]), config=self.model.config, max_len=self.max_len,
            kv_len=kv_len, first_layer=self.bounds[last], embed=False)
        self._log(last, chain, "prefill", rows, bucket, kv_len)
        return out

    def decode(self, longest: int, slots=None) -> jax.Array:
        """`decode_steps` steps of every slot (whatever `slots` says: the micro-batches are
        fixed), micro-batch by micro-batch through the stages; returns `[steps, slots]` tokens
        (or -1), as `Engine.decode`."""
        del slots
        steps = self.config.decode_steps
        kv_len = self._attended_len(longest + steps)
        last = self.stages - 1
        rows = self.num_slots // self.micro_batches
        outs = []
        for _ in range(steps):
            step_out = []
            for g, group in enumerate(self.groups):
                tokens, active = _decode_inputs(self.state, group[last])
                x = tokens
                for s in range(last):
                    x, self.caches[s] = _decode_stage(
                        self.stage_params[s], self.caches[s], jax.device_put(x, self.devices[s]),
                        jax.device_put(active, self.devices[s]), group[s], config=self.model.config,
                        kv_len=kv_len, first_layer=self.bounds[s], embed=s == 0)
                    self._log(s, ("decode", g), "decode", rows, 1, kv_len)
                out, self.caches[last], self.state = _decode_last(
                    self.stage_params[last], self.caches[last], self.state, jax.device_put(x, self.devices[last]),
                    group[last], config=self.model.config, max_len=self.max_len, kv_len=kv_len,
                    first_layer=self.bounds[last])
                self._log(last, ("decode", g), "decode", rows, 1, kv_len)
                step_out.append(out)
            outs.append(jnp.concatenate(step_out))
        return jnp.stack(outs)


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
