"""The jitted device steps: `prefill` (per length bucket, straight into a slot) and `decode`.

JetStream's vocabulary: `prefill` computes a prompt chunk's keys and values and
`insert`s them into a slot; `generate`/`decode` advances every active slot. Here
the insert is fused into the prefill program: the chunk's K/V are scattered
straight into the slot's rows of the donated decode cache (no separate prefix
cache to copy), and the slot's decode state (last token, sampling parameters,
stop tokens, budget) is set in the same program.

Every step returns one small int32 array the host copies once:
prefill `[2]` = (first token, done), decode `[steps, slots]` = token or -1.
Programs are compiled per (prefill bucket, attended length) and per decode
attended-length bucket, so their number is bounded by the buckets, and a steady
workload never recompiles (`TRACE_COUNTS` counts traces).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.checkpoint import Model
from cbjax.kv_cache import SlotCache
from cbjax.models import forward
from cbjax.request import SamplingParams
from cbjax.sampling import sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Per-slot decode state on the device."""

    tokens: jax.Array  # [S] int32: last sampled token, the next decode input
    active: jax.Array  # [S] bool
    num_generated: jax.Array  # [S] int32
    max_tokens: jax.Array  # [S] int32
    temperature: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32
    top_p: jax.Array  # [S] float32
    seeds: jax.Array  # [S] int32
    stop_ids: jax.Array  # [S, max_stop_tokens] int32, -1 padded

    @classmethod
    def init(cls, num_slots: int, max_stop_tokens: int) -> "SlotState":
        # Distinct buffers per field: the state is donated, and XLA refuses to donate one buffer twice.
        def zeros(dtype=jnp.int32):
            return jnp.zeros((num_slots,), dtype)

        return cls(tokens=zeros(), active=zeros(bool), num_generated=zeros(), max_tokens=zeros(),
                   temperature=zeros(jnp.float32), top_k=zeros(), top_p=jnp.ones((num_slots,), jnp.float32),
                   seeds=zeros(), stop_ids=jnp.full((num_slots, max_stop_tokens), -1, jnp.int32))


# Layout of the packed int32 row that carries one prefill's scalars to the device (one
# host-to-device copy instead of one per scalar: on CPU that was most of a small prefill).
_SLOT, _START, _LENGTH, _IS_LAST, _MAX_TOKENS, _TOP_K, _SEED, _STOP = range(8)


def prefill_buckets(floor: int, max_len: int) -> list[int]:
    buckets, b = [], floor
    while b < max_len:
        buckets.append(b)
        b *= 2
    return buckets + [max_len]


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}")


def _is_done(token, stop_ids, num_generated, max_tokens, total_len, max_len):
    is_stop = jnp.any(token[..., None] == stop_ids, axis=-1)
    return is_stop | (num_generated >= max_tokens) | (total_len >= max_len)


# Traces per program, across engines: the body of a jitted function runs once per
# compilation, so counting there counts compilations (tests assert it stops growing).
TRACE_COUNTS: collections.Counter = collections.Counter()

_STATIC = ("config", "max_len", "kv_len")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache", "state"))
def _prefill_step(params, cache, state, tokens, ints, floats, *, config, max_len, kv_len):
    """Write a prompt chunk into a slot; when it is the last chunk, sample the first token
    and set the slot's decode state (a traced flag, so chunked and whole prefills share
    one program). `ints` and `floats` are the packed scalars (see `_SLOT` and friends)."""
    TRACE_COUNTS[("prefill", config, tokens.shape[0], kv_len, cache.num_slots)] += 1
    slot, start, length, max_tokens, top_k, seed = (ints[i] for i in (_SLOT, _START, _LENGTH, _MAX_TOKENS,
                                                                     _TOP_K, _SEED))
    is_last, stop_ids = ints[_IS_LAST] > 0, ints[_STOP:]
    temperature, top_p = floats[0], floats[1]
    logits, cache = forward(params, config, cache, tokens[None], start[None], num_valid=length[None],
                            slot_ids=slot[None], kv_len=kv_len, logits_index=length[None] - 1)
    zero = jnp.zeros((1,), jnp.int32)
    token = sample(logits, temperature[None], top_k[None], top_p[None], seed[None], zero)[0]
    done = _is_done(token, stop_ids, 1, max_tokens, start + length + 1, max_len)
    inserted = SlotState(
        tokens=state.tokens.at[slot].set(token),
        active=state.active.at[slot].set(~done),
        num_generated=state.num_generated.at[slot].set(1),
        max_tokens=state.max_tokens.at[slot].set(max_tokens),
        temperature=state.temperature.at[slot].set(temperature),
        top_k=state.top_k.at[slot].set(top_k),
        top_p=state.top_p.at[slot].set(top_p),
        seeds=state.seeds.at[slot].set(seed),
        stop_ids=state.stop_ids.at[slot].set(stop_ids),
    )
    state = jax.tree.map(lambda new, old: jnp.where(is_last, new, old), inserted, state)
    return jnp.stack([token, (done & is_last).astype(jnp.int32)]), cache, state


@functools.partial(jax.jit, static_argnames=_STATIC + ("steps",), donate_argnames=("cache", "state"))
def _decode_steps(params, cache, state, *, config, max_len, kv_len, steps):
    TRACE_COUNTS[("decode", config, kv_len, steps, cache.num_slots)] += 1

    def one_step(carry, _):
        cache, state = carry
        logits, cache = forward(params, config, cache, state.tokens[:, None], cache.lengths,
                                num_valid=state.active.astype(jnp.int32), kv_len=kv_len,
                                logits_index=jnp.zeros_like(state.tokens))
        token = sample(logits, state.temperature, state.top_k, state.top_p, state.seeds, state.num_generated)
        generated = state.num_generated + state.active
        done = state.active & _is_done(token, state.stop_ids, generated, state.max_tokens, cache.lengths + 1,
                                       max_len)
        out = jnp.where(state.active, token, -1)
        state = dataclasses.replace(state, tokens=jnp.where(state.active, token, state.tokens),
                                    active=state.active & ~done, num_generated=generated)
        return (cache, state), out

    (cache, state), out = jax.lax.scan(one_step, (cache, state), None, length=steps)
    return out, cache, state


@functools.partial(jax.jit, donate_argnames="state")
def _deactivate(state, slot):
    return dataclasses.replace(state, active=state.active.at[slot].set(False))


@dataclasses.dataclass
class EngineConfig:
    num_slots: int = 8
    max_seq_len: int = 512
    prefill_floor: int = 16
    decode_steps: int = 1
    max_stop_tokens: int = 16
    dtype: str = "float32"

    def __post_init__(self):
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.prefill_floor < 1 or self.decode_steps < 1:
            raise ValueError("prefill_floor and decode_steps must be >= 1")


class Engine:
    def __init__(self, model: Model, config: EngineConfig):
        self.model = model
        self.config = config
        mc = model.config
        if config.max_seq_len > mc.max_position_embeddings:
            raise ValueError(f"max_seq_len {config.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{mc.max_position_embeddings}")
        self.params = model.params
        self.max_len = config.max_seq_len
        self.buckets = prefill_buckets(min(config.prefill_floor, self.max_len), self.max_len)
        dtype = jax.tree.leaves(self.params)[0].dtype
        self.cache = SlotCache.init(mc, config.num_slots, self.max_len, dtype)
        self.state = SlotState.init(config.num_slots, config.max_stop_tokens)
        self.eos_ids = tuple(mc.eos_token_ids)

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    def stop_ids_for(self, sampling: SamplingParams) -> np.ndarray:
        ids = list(sampling.stop_token_ids) + ([] if sampling.ignore_eos else list(self.eos_ids))
        ids = sorted(set(ids))
        if len(ids) > self.config.max_stop_tokens:
            raise ValueError(f"at most {self.config.max_stop_tokens} stop tokens (EOS included) per request, "
                             f"got {len(ids)}")
        out = np.full((self.config.max_stop_tokens,), -1, np.int32)
        out[:len(ids)] = ids
        return out

    def _attended_len(self, needed: int) -> int:
        return bucket_for(min(needed, self.max_len), self.buckets)

    def prefill(self, slot: int, tokens: list[int], start: int, is_last: bool,
                sampling: SamplingParams, seed: int) -> jax.Array | None:
        """Write a prompt chunk into `slot` at `start`. For the last chunk, also sample the
        first token and make the slot active; returns the device array (token, done)."""
        n = len(tokens)
        bucket = bucket_for(n, self.buckets)
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = tokens
        kv_len = bucket if start == 0 else self._attended_len(start + n)
        ints = np.concatenate([np.array([slot, start, n, is_last, sampling.max_tokens, sampling.top_k, seed],
                                        np.int32), self.stop_ids_for(sampling)])
        floats = np.array([sampling.temperature, sampling.top_p], np.float32)
        out, self.cache, self.state = _prefill_step(self.params, self.cache, self.state, padded, ints, floats,
                                                    config=self.model.config, max_len=self.max_len,
                                                    kv_len=kv_len)
        return out if is_last else None

    def decode(self, longest: int) -> jax.Array:
        """`decode_steps` steps for every active slot; `longest` is the largest sequence length
        (prompt + generated) among active slots, which sets the attended-length bucket."""
        steps = self.config.decode_steps
        kv_len = self._attended_len(longest + steps)
        out, self.cache, self.state = _decode_steps(self.params, self.cache, self.state, config=self.model.config,
                                                    max_len=self.max_len, kv_len=kv_len, steps=steps)
        return out

    def programs(self, chunked: bool = False, max_prompt_len: int | None = None) -> list[tuple]:
        """Every program a workload can need: (kind, tokens bucket, attended length).
        `max_prompt_len` leaves out prefill buckets no prompt of the workload reaches."""
        top = self.max_len if max_prompt_len is None else bucket_for(min(max_prompt_len, self.max_len), self.buckets)
        progs = [("prefill", b, b) for b in self.buckets if b <= top]
        progs += [("decode", 1, kv) for kv in self.buckets]
        if chunked:
            progs += [("prefill", b, kv) for b in self.buckets for kv in self.buckets if kv > b and b <= top]
        return progs

    def warmup(self, chunked: bool = False, max_prompt_len: int | None = None) -> int:
        """Compile every program up front (so timings and latencies exclude compilation);
        leaves the engine empty. Returns the number of programs."""
        greedy = SamplingParams(max_tokens=1)
        progs = self.programs(chunked, max_prompt_len)
        for kind, bucket, kv_len in progs:
            if kind == "decode":
                out = self.decode(max(kv_len - self.config.decode_steps, 0))
            else:
                start = kv_len - bucket  # start > 0 selects the attended length kv_len
                out = self.prefill(0, [0] * bucket, start, True, greedy, 0)
            if out is not None:
                out.block_until_ready()
        self.reset()
        return len(progs)

    def reset(self) -> None:
        """Drop every sequence: all slots free and inactive."""
        dtype = self.cache.k.dtype
        self.cache = SlotCache.init(self.model.config, self.num_slots, self.max_len, dtype)
        self.state = SlotState.init(self.num_slots, self.config.max_stop_tokens)

    def deactivate(self, slot: int) -> None:
        self.state = _deactivate(self.state, jnp.int32(slot))

    @staticmethod
    def num_compilations() -> int:
        """Traces of the engine's jitted steps so far, across all engines in this process."""
        return sum(TRACE_COUNTS.values())
