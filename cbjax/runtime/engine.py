"""The device engine: `prefill` (per length bucket, straight into a slot), `decode` and
`mixed_step` over the jitted programs (programs.py, mixed_step.py).

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

import dataclasses

import jax
import numpy as np

from cbjax.models import cpu_kernels
from cbjax.models.kv_cache import PagedCache, SlotCache
from cbjax.request import SamplingParams
from cbjax.runtime import programs, row_packing, sharding
from cbjax.runtime.device_state import BACKEND_COMPILES, TRACE_COUNTS, SlotState  # noqa: F401 (re-exported)
from cbjax.runtime.engine_config import (CPU_KERNEL_CHOICES, EngineConfig, bucket_for,  # noqa: F401 (re-exported)
                                         prefill_buckets)
from cbjax.runtime.mixed_step import mixed_step, pack, row_bucket, token_buckets
from cbjax.scheduling.plan import Row


def use_cpu_kernels(choice: str, params, mesh) -> bool:
    """ModelConfig.cpu_kernels for an engine: the kernels need f32 weights on one CPU device."""
    if choice == "off":
        return False
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    embed = params["embed"]
    why_not = ("the engine is not on one CPU device" if len(devices) != 1 or devices[0].platform != "cpu"
               else f"the weights are {embed.dtype}, the kernel is f32" if embed.dtype != np.float32
               else cpu_kernels.build_error())
    if why_not is None:
        return True
    if choice == "on":
        raise ValueError(f"cpu_kernels='on' is unavailable: {why_not}")
    return False


class Engine:
    reads_block_tables = True  # the paged cache's tables are copied to the device each round
    # Its decode reads each slot's last token from the device state, so the host may dispatch the
    # next decode before reading this one's tokens (EngineCore's overlap).
    can_run_ahead = True

    def __init__(self, model, config: EngineConfig, mesh=None):
        """`model`: a loaded model (`.config`, `.params`). `mesh`: a tensor-parallel
        `jax.sharding.Mesh` (runtime/sharding.py) to shard the params and the KV cache over;
        None keeps everything on the default device."""
        self._configure(model, config)
        mc = model.config
        self.mesh = mesh
        if mesh is not None:
            sharding.check_divisible(mc, mesh)
            if config.attention == "pallas" and sharding.tp_size(mesh) > 1:
                raise ValueError("attention='pallas' does not run tensor-parallel yet: use attention='reference'")
            self.params = sharding.shard_params(model.params, mc, mesh)
        else:
            self.params = model.params
        # The model config the programs are traced with: the model's, plus which kernels they use.
        self.program_config = mc.replace(cpu_kernels=use_cpu_kernels(config.cpu_kernels, self.params, mesh))
        self.reset()

    def _configure(self, model, config: EngineConfig) -> None:
        """What every engine kind sets up, the simulated one included: the model, the config
        (checked against the model) and the length buckets."""
        if config.max_seq_len > model.config.max_position_embeddings:
            raise ValueError(f"max_seq_len {config.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{model.config.max_position_embeddings}")
        self.model = model
        self.config = config
        self.max_len = config.max_seq_len
        self.buckets = prefill_buckets(min(config.prefill_floor, self.max_len), self.max_len)
        self.eos_ids = tuple(model.config.eos_token_ids)
        self.max_logprobs = config.max_logprobs  # what its programs compute (0 on engines without them)

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    def stop_ids_for(self, sampling: SamplingParams) -> np.ndarray:
        return row_packing.stop_ids(sampling, self.eos_ids, self.config.max_stop_tokens)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Refuse (ValueError) sampling parameters this engine cannot apply."""
        self.stop_ids_for(sampling)  # refuses too many stop ids
        row_packing.check_sampling(sampling, self.max_logprobs, self.config.max_logit_bias,
                                   self.model.config.vocab_size)

    def sampling_row(self, row: Row | None) -> tuple[np.ndarray, np.ndarray]:
        """A row's packed sampling parameters; None: a row that samples nothing."""
        stops = self.stop_ids_for(row.sampling) if row is not None else None
        return row_packing.sampling_row(row, stops, self.config.max_stop_tokens, self.config.max_logit_bias)

    def _record_histories(self, rows: list[Row]) -> None:
        """The penalties' history of rows whose request starts past position 0."""
        for row in rows:
            if row.history:
                self.state = programs.record_history(self.state, np.int32(row.slot),
                                                     row_packing.history_tokens(row, self.buckets),
                                                     np.int32(row.prompt_len))

    def _pack_prefill(self, chunks: list[Row], bucket: int) -> tuple[np.ndarray, ...]:
        return row_packing.pack_prefill(chunks, bucket, self.sampling_row)

    def _attended_len(self, needed: int) -> int:
        return bucket_for(min(needed, self.max_len), self.buckets)

    def prefill(self, chunks: list[Row]) -> list[tuple[jax.Array, list[int]]]:
        """Write prompt chunks into their slots, in as few device calls as the buckets allow:
        chunks sharing a (length bucket, attended length) go together, in row batches of a
        power of two up to `max_prefill_batch`. For each chunk that ends its prompt, the
        slot's first token is sampled and the slot made active. Returns, per call, the device
        array `[rows, 2]` of (first token, done) and the indices of `chunks` in its rows."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, c in enumerate(chunks):
            n = len(c.tokens)
            bucket = bucket_for(n, self.buckets)
            # A fresh prompt reads nothing from the cache (kv_len 0); a later chunk reads its slot's
            # history up to the bucket of where the chunk ends.
            kv_len = 0 if c.start == 0 else self._attended_len(c.start + n)
            groups.setdefault((bucket, kv_len), []).append(i)
        self._record_histories(chunks)
        calls = []
        limit = self.config.max_prefill_batch
        for (bucket, kv_len), members in groups.items():
            for k in range(0, len(members), limit):
                rows = members[k:k + limit]
                calls.append((self._prefill_call([chunks[i] for i in rows], bucket, kv_len), rows))
        return calls

    def _prefill_call(self, chunks: list[Row], bucket: int, kv_len: int) -> jax.Array:
        tokens, ints, floats = self._pack_prefill(chunks, bucket)
        out, self.cache, self.state = programs.prefill_step(self.params, self.cache, self.state, tokens, ints, floats,
                                                            config=self.program_config, max_len=self.max_len,
                                                            kv_len=kv_len, max_logprobs=self.max_logprobs)
        return out

    @property
    def mixed(self) -> bool:
        return self.config.merge_mode != "prefill_first"

    def _mixed_token_buckets(self) -> list[int]:
        most = self.config.max_num_batched_tokens or self.max_len + self.num_slots
        if self.config.merge_mode == "fused":  # a whole prompt alone may exceed the budget
            most = max(most, self.max_len)
        return token_buckets(most)

    def mixed_step(self, rows: list[Row]) -> jax.Array:
        """One mixed step over `rows` (prefill chunks and decodes, any order); returns the
        device array `[rows bucket, 2]` of (sampled token or -1, done), row i first."""
        total = sum(r.num_tokens for r in rows)
        num_tokens = bucket_for(total, self._mixed_token_buckets())
        kv_len = self._attended_len(max(r.start + r.num_tokens for r in rows))
        self._record_histories(rows)
        return self._mixed_call(pack(rows, num_tokens, row_bucket(num_tokens, self.num_slots), self.sampling_row),
                                kv_len)

    def _mixed_call(self, packed: tuple[np.ndarray, ...], kv_len: int) -> jax.Array:
        out, self.cache, self.state = mixed_step(self.params, self.cache, self.state, *packed,
                                                 config=self.program_config, max_len=self.max_len, kv_len=kv_len,
                                                 max_logprobs=self.max_logprobs,
                                                 paged_kernel=self.config.attention == "pallas")
        return out

    def decode(self, longest: int, slots=None) -> jax.Array:
        """`decode_steps` steps for every active slot; `longest` is the largest sequence length
        (prompt + generated) among active slots, which sets the attended-length bucket.
        `slots`: the slots that may be active (None: all); only those are computed, in a row
        bucket of a power of two (every slot once the bucket would reach `num_slots`)."""
        steps = self.config.decode_steps
        kv_len = self._attended_len(longest + steps)
        out, self.cache, self.state = programs.decode_steps(
            self.params, self.cache, self.state, self._decode_rows(slots), config=self.program_config,
            max_len=self.max_len, kv_len=kv_len, steps=steps, max_logprobs=self.max_logprobs,
            paged_kernel=self.config.attention == "pallas")
        return out

    def decode_row_buckets(self) -> list[int]:
        """Row counts a decode call is compiled for: powers of two below `num_slots`, then
        every slot (None)."""
        return [1 << i for i in range((self.num_slots - 1).bit_length())] + [None]

    def decode_rows_computed(self, slots) -> int:
        """How many rows a decode call over `slots` (None: all) computes."""
        if slots is None:
            return self.num_slots
        return min(1 << max(len(slots) - 1, 0).bit_length(), self.num_slots)

    def _decode_rows(self, slots) -> jax.Array | None:
        rows = self.decode_rows_computed(slots)
        if rows == self.num_slots:
            return None
        slots = sorted(slots)
        padded = np.full((rows,), self.num_slots, np.int32)
        padded[:len(slots)] = slots
        return self.put(padded)

    def programs(self, chunked: bool = False, max_prompt_len: int | None = None) -> list[tuple]:
        """Every program a workload can need: ("prefill", rows, tokens bucket, attended length)
        and ("decode", attended length, rows or None for every slot). `max_prompt_len` leaves out prefill buckets no
        prompt of the workload reaches."""
        if self.mixed:
            return [("mixed", t, kv) for t in self._mixed_token_buckets() for kv in self.buckets]
        if self.config.kv_cache == "paged":
            max_prompt_len = None  # a request resumed after preemption prefills prompt + output
        top = self.max_len if max_prompt_len is None else bucket_for(min(max_prompt_len, self.max_len), self.buckets)
        shapes = [(b, 0) for b in self.buckets if b <= top]
        if chunked:
            shapes += [(b, kv) for b in self.buckets for kv in self.buckets if kv >= b and b <= top]
        # A call batches at most one chunk per slot, padded to a power of two: row counts past
        # the slots' next power of two are never reached, so they are not compiled.
        most_rows = min(self.config.max_prefill_batch, 1 << (self.num_slots - 1).bit_length())
        rows = [1 << i for i in range(most_rows.bit_length())]
        progs = [("prefill", r, b, kv) for r in rows for b, kv in shapes]
        return progs + [("decode", kv, rows) for kv in self.buckets for rows in self.decode_row_buckets()]

    def warmup(self, chunked: bool = False, max_prompt_len: int | None = None, only: str | None = None) -> int:
        """Compile every program up front (so timings and latencies exclude compilation);
        leaves the engine empty. Returns the number of programs. `only`: programs of that
        kind ("prefill" or "decode": a disaggregated instance's)."""
        greedy = SamplingParams(max_tokens=1)
        progs = [p for p in self.programs(chunked, max_prompt_len) if only in (None, p[0])]
        for prog in progs:
            if prog[0] == "mixed":
                _, num_tokens, kv_len = prog
                out = self._mixed_call(pack([], num_tokens, row_bucket(num_tokens, self.num_slots),
                                            self.sampling_row), kv_len)
            elif prog[0] == "decode":
                _, kv_len, rows = prog
                out = self.decode(max(kv_len - self.config.decode_steps, 0), None if rows is None else range(rows))
            else:
                _, rows, bucket, kv_len = prog
                chunk = [Row(0, [0] * bucket, max(kv_len - bucket, 0), True, greedy)]
                out = self._prefill_call(chunk * rows, bucket, kv_len)
            jax.block_until_ready(out)
        # Forks of n > 1 samples (any configuration) and prefix hits start past position 0: their
        # KV copies and the penalties' history of the tokens before them.
        for bucket in self.buckets if only != "decode" else ():
            self._record_histories([Row(0, [], 0, history=[0] * bucket)])
        for size in (1 << i for i in range((self.num_slots - 1).bit_length() + 1)) if only != "decode" else ():
            self.copy_kv([(0, 0)] * size)
        self.deactivate(0)  # abort and preemption
        self.reset()
        return len(progs)

    def reset(self) -> None:
        """Drop every sequence: all slots free and inactive."""
        self.cache, self.state = init_cache_and_state(self.model.config, self.config,
                                                      jax.tree.leaves(self.params)[0].dtype, self.mesh)
        self._tables = None

    def set_block_tables(self, tables: np.ndarray) -> None:
        """Paged cache: the host's block tables `[slots, pages_per_seq]` (copied only on change)."""
        if self._tables is None or not np.array_equal(tables, self._tables):
            self._tables = tables.copy()
            self.cache = dataclasses.replace(self.cache, block_tables=self.put(np.asarray(tables, np.int32)))

    def put(self, host: np.ndarray) -> jax.Array:
        """A small host array onto the device(s): replicated over the mesh when there is one."""
        if self.mesh is None:
            return jax.device_put(host)  # not jnp.asarray: without a dtype it compiles a copy per shape
        return sharding.place(host, sharding.replicated(self.mesh))

    def copy_kv(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV (source, destination): pages of a paged cache, whole slots of the slot cache
        (forks of a sibling's prompt). Padded to a power of two, so programs stay few."""
        src, dst = row_packing.copy_pairs(copies)
        self.cache = programs.copy_kv(self.cache, self.put(src), self.put(dst))

    def deactivate(self, slot: int) -> None:
        self.state = programs.deactivate(self.state, np.int32(slot))

    @staticmethod
    def num_compilations() -> int:
        """Traces of the engine's jitted steps so far, across all engines in this process."""
        return sum(TRACE_COUNTS.values())

    @staticmethod
    def num_backend_compilations() -> int:
        """XLA compilations of anything in this process so far."""
        return BACKEND_COMPILES[0]


def init_cache_and_state(model_config, c: EngineConfig, dtype, mesh) -> tuple:
    """An empty KV cache and slot state; on a mesh, made in place (a jitted init with output
    shardings), never whole on one device."""
    if c.kv_cache == "paged":
        def init_cache():
            return PagedCache.init(model_config, c.num_slots, c.max_seq_len, c.num_pages, c.page_size, dtype)
    else:
        def init_cache():
            return SlotCache.init(model_config, c.num_slots, c.max_seq_len, dtype)

    def init_state():
        return SlotState.init(c.num_slots, c.max_stop_tokens, c.max_logit_bias, model_config.vocab_size)

    if mesh is None:
        return init_cache(), init_state()
    rep = sharding.replicated(mesh)
    shape = jax.eval_shape(init_cache)
    kv = sharding.kv_sharding(model_config, mesh, shape.head_axis, shape.k[0].ndim)
    layout = jax.tree.map(lambda _: rep, shape)
    layout = dataclasses.replace(layout, k=(kv,) * len(shape.k), v=(kv,) * len(shape.v))
    cache = dataclasses.replace(jax.jit(init_cache, out_shardings=layout)(), kv_sharding=kv)
    return cache, jax.jit(init_state, out_shardings=rep)()
