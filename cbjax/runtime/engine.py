"""The device engine: `run` puts a round's rows (prompt chunks, decodes, or both) through
the one jitted step (step.py; its inputs packed by packing.py), in calls of at most the step budget.

JetStream's vocabulary: `prefill` computes a prompt chunk's keys and values and
`insert`s them into a slot; `generate`/`decode` advances every active slot. Here both are
rows of the same step: a prompt row scatters its keys and values straight into its
slot's part of the donated cache and, when it ends the prompt, sets the slot's decode
state (last token, sampling parameters, stop tokens, budget); a decode row advances it.

Programs are keyed by the token bucket alone (powers of two up to the step budget, and
`token_bucket_steps` sizes per doubling above the prefill floor), plus
one per bucket of decode rows when `decode_steps > 1`: their number does not grow with
`max_seq_len`, and a steady workload never recompiles (`TRACE_COUNTS` counts traces).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from cbjax.models.fusion import is_fused
from cbjax.models.kv_cache import PagedCache, SlotCache
from cbjax.request import ALL, SamplingParams, Sampler
from cbjax.runtime import packing
from cbjax.runtime.compiled import kernel_tuning
from cbjax.runtime.scale import sharding
from cbjax.runtime.traced import programs
from cbjax.runtime.cpu import kernels as cpu_kernels
from cbjax.runtime.traced.device_state import BACKEND_COMPILES, TRACE_COUNTS, SlotState  # noqa: F401 (re-exported)
from cbjax.runtime.engine_choices import choose_attention, kv_dtype
from cbjax.runtime.engine_ops import engine_ops
from cbjax.runtime.engine_config import EngineConfig, prefill_buckets
from cbjax.runtime.host_kv import HostKV
from cbjax.runtime.lora_pool import DeviceAdapters
from cbjax.models.quant import activation_dtype
from cbjax.runtime.prompt_logprobs import PromptScorer
from cbjax.runtime.packing import pack, row_bucket, token_buckets
from cbjax.runtime.interface import EngineInfo
from cbjax.runtime.compiled.step_programs import SamplerVariants, StepPrograms, reachable_programs
from cbjax.runtime.compiled.warmup import warm_up
from cbjax.scheduling.plan import Row

# (device result, for each row of the call the index of the round's row whose result it is,
# or -1 for a piece of a prompt chunk that continues in a later call)
Call = tuple[object, list[int]]


class EngineBase:
    """What every engine kind shares, the simulated one included: its shape (the config checked
    against the model, the attention it runs, the token buckets) and how a round's rows
    become calls (split under the step budget, each call's bucket, the rows' sampling)."""

    kind = "engine"
    kernel_launches: dict = {}  # (kernel, shape) -> the launch its warm-up tuned (Engine.warmup sets it)
    ops = None  # the operations its programs are traced with (`Ops`); None: it traces nothing
    mesh = None  # a tensor-parallel mesh, or None
    lora = None  # its LoRA adapter pool (`DeviceAdapters`), or None: it serves the base model alone
    takes_sampler_variants = False

    def take_expert_tokens(self) -> list:
        """The tokens each MoE layer sent to each expert (`[MoE layers, experts]` device arrays) in
        the calls run since the last take; none for a dense model or an engine that computes nothing."""
        taken, self._expert_tokens = self._expert_tokens, []
        return taken

    def take_prompt_scores(self) -> list:
        """(device `[S, 2 + 2k]` score columns, pieces (a `PromptScores`, its first column, the
        positions of the tokens scored)) of the calls run since the last take, for `PromptScores.fill`."""
        taken, self._prompt_scores = self._prompt_scores, []
        return taken

    def _configure(self, model, config: EngineConfig, tensor_parallel: int = 1) -> None:
        """What every engine kind sets up, the simulated one included: the model, the config
        (checked against the model), the attention it runs and the length buckets."""
        if config.max_seq_len > model.config.max_position_embeddings:
            raise ValueError(f"max_seq_len {config.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{model.config.max_position_embeddings}")
        self.attention = choose_attention(model, config, self.platform, tensor_parallel)
        self.samplers = SamplerVariants(config.num_slots, self.platform, self.takes_sampler_variants)
        self.model = model
        self.config = config
        self._expert_tokens = []  # a MoE engine's tokens per expert of the calls not yet recorded (device arrays)
        self._prompt_scores = []  # (device score columns, their scored pieces) of calls not yet collected
        self.max_len = config.max_seq_len
        self.buckets = prefill_buckets(min(config.prefill_floor, self.max_len), self.max_len)
        self.eos_ids = tuple(model.config.eos_token_ids)
        # What its programs compute (0 on engines without them); never more than the vocabulary holds.
        self.max_logprobs = min(config.max_logprobs, model.config.vocab_size)
        self.step_tokens = config.step_tokens(self.platform)
        # Positions a verify row's program samples (its last token and the proposal); 0: no speculation.
        self.verify_positions = config.num_speculative_tokens + 1 if config.num_speculative_tokens else 0
        if self.verify_positions > self.step_tokens:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens}: a verify row of "
                             f"{self.verify_positions} tokens exceeds the step's {self.step_tokens}")
        self._token_buckets = token_buckets(self.step_tokens, config.token_bucket_steps, config.prefill_floor,
                                            config.smallest_step(self.platform))

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    def info(self) -> EngineInfo:
        return EngineInfo(self.platform, self.kind, self.attention, self.num_slots, self.max_len,
                          tuple(self._token_buckets), repr(self.ops), self.num_devices,
                          tuple((kernel, shape, choice) for (kernel, shape), choice in self.kernel_launches.items()),
                          bool(self.model.params) and is_fused(self.model.params))

    @property
    def num_devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.devices.size

    def stop_ids_for(self, sampling: SamplingParams) -> np.ndarray:
        return packing.stop_ids(sampling, self.eos_ids, self.config.max_stop_tokens)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Refuse (ValueError) sampling parameters this engine cannot apply."""
        self.stop_ids_for(sampling)  # refuses too many stop ids
        packing.check_sampling(sampling, self.max_logprobs, self.config.max_logit_bias, self.model.config.vocab_size)

    def sampling_row(self, row: Row | None) -> tuple[np.ndarray, np.ndarray]:
        """A row's packed sampling parameters; None: a row that samples nothing."""
        stops = self.stop_ids_for(row.sampling) if row is not None else None
        return packing.sampling_row(row, stops, self.config.max_stop_tokens, self.config.max_logit_bias)

    @property
    def mixed(self) -> bool:
        return self.config.merge_mode != "prefill_first"

    def token_buckets(self) -> list[int]:
        """The flat-buffer sizes a step is compiled for, up to the step budget (`packing.token_buckets`)."""
        return list(self._token_buckets)

    def history_block(self) -> int:
        """Positions per block of the reference attention's history read (`packing.history_block`)."""
        return packing.history_block(self.config, self.max_len)

    def split(self, rows: list[Row]) -> list[list[tuple[int, Row]]]:
        """The round's rows in calls of at most the step budget (`packing.split_rows`)."""
        return packing.split_rows(rows, self.step_tokens)

    def call_tokens(self, rows: list[Row]) -> int:
        """The token bucket of one call; a call with prompt rows pads to at least `prefill_floor`."""
        buckets = self._token_buckets
        total = sum(r.num_tokens for r in rows)
        if any(not r.decodes for r in rows):
            total = max(total, min(self.config.prefill_floor, buckets[-1]))
        return next(b for b in buckets if b >= total)

    def programs(self, only: str | None = None) -> list[tuple]:
        """Every program a workload can reach: ("step", tokens bucket, steps), and with speculation
        ("verify", tokens bucket, 1). `only="decode"`: those of decode rows alone (a disaggregated
        decode instance's); "prefill": of prompt rows."""
        return reachable_programs(self.token_buckets(), self.num_slots, self.config.decode_steps, only,
                                  self.verify_positions, self.mixed)


class Engine(EngineBase):
    reads_block_tables = True  # the paged cache's tables are copied to the device each round
    # Its decode reads each slot's last token from the device state, so the host may dispatch the
    # next decode before reading this one's tokens (EngineCore's overlap).
    can_run_ahead = True
    supports_structured_output = True  # its step applies structured-output masks
    takes_sampler_variants = True  # its step compiles only the sampling its rows need (step_programs.py)
    scores_prompts = True  # its step scores prompt rows that ask for prompt logprobs (cbjax/prompt_scores.py)
    host_kv: HostKV | None = None  # the KV cache's host tier (swapped-out sequences, prefix pages)
    host_s = 0.0  # seconds of KV moves over the host link, where they are simulated
    call_log: Sequence = ()  # rounds of stage calls, where a pipeline logs them (runtime/scale/pipeline.py)

    def __init__(self, model, config: EngineConfig, mesh=None):
        """`model`: a loaded model (`.config`, `.params`). `mesh`: a tensor-parallel
        `jax.sharding.Mesh` (runtime/scale/sharding.py) to shard the params and the KV cache over;
        None keeps everything on the default device."""
        self.platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        self._configure(model, config, sharding.tp_size(mesh) if mesh is not None else 1)
        mc = model.config
        self.mesh = mesh
        if mesh is not None:
            sharding.check_divisible(mc, mesh)
            self.params = sharding.shard_params(model.params, mc, mesh)
        else:
            self.params = model.params
        # The operations the programs are traced with: the C++ CPU kernels, the Pallas quantized matmul, or XLA's.
        self.ops = engine_ops(config, self.params, mesh)
        # Programs run by the CPU layer kernel alone take the weights by address (LayerAddresses).
        addresses = (self.ops is cpu_kernels.CPU_KERNELS and self.attention != "pallas" and cpu_kernels.reads_cache(
            kv_dtype(model, config)) and cpu_kernels.layer_addresses(self.params, mc))
        self._params_by_address = {**self.params, "layers": addresses} if addresses else None
        self.lora = DeviceAdapters(mc, config.lora_modules(), config.max_loras, config.max_lora_rank,
                                   activation_dtype(self.params), self.put) if config.enable_lora else None
        self.compiled = StepPrograms()
        self._slot_decodes = {}  # packed arrays of slot-only decode rows by (tokens, slots)
        self.host_kv = HostKV()
        self.reset()

    def wait_for_compiles(self) -> int:
        return self.compiled.wait()

    def prompt_scorer(self, ids: list[int], k: int) -> PromptScorer:
        """A prompt's logprobs, by one more forward over it a chunk at a time (one program per
        engine): for an engine whose step does not score prompts (`scores_prompts`)."""
        return PromptScorer(self.params, self.model.config, ids, k, self.max_len, self.max_logprobs, ops=self.ops,
                            history_block=self.history_block())

    def prompt_logprobs(self, ids: list[int], k: int) -> list:
        """Each prompt token's `TokenLogprob` (None for the first), the scorer run at once."""
        return self.prompt_scorer(ids, k).run()

    def record_histories(self, rows: list[Row]) -> None:
        """The penalties' history of rows that start a request whose logits processors read it:
        set from the tokens before it past position 0, cleared at 0 (no tokens)."""
        for row in rows:
            if row.history or row.starts_history:
                self.state = programs.record_history(self.state, np.int32(row.slot),
                                                     packing.history_tokens(row, self.buckets),
                                                     np.int32(row.prompt_len))

    def run(self, rows: list[Row], steps: int = 1) -> list[Call]:
        """Dispatch the round's rows (any mix of prompt chunks and decodes; `steps > 1` only for
        decode rows, which feed themselves); nothing waits for the device. Each call returns
        `[steps, rows bucket, 2]` (token or -1, done) on the device."""
        if steps > 1 and not all(r.is_decode for r in rows):
            raise ValueError("several steps in one call run decode rows only")
        self.record_histories(rows)
        calls = []
        for members in self.split(rows):
            call_rows = [r for _, r in members]
            sampler = self.samplers.for_rows(call_rows)
            verify = self.verify_positions if any(r.verify for r in call_rows) else 0
            num_tokens = self.call_tokens(call_rows)
            to_score, pieces, k = packing.score_targets(call_rows, num_tokens)
            prompt_k = self.max_logprobs if k else 0  # top entries computed: none, or as many as any request takes
            result = self._dispatch(self._pack(call_rows, num_tokens, to_score), steps, sampler, verify, prompt_k)
            if pieces:
                result, columns = result
                self._prompt_scores.append((columns, pieces))
            calls.append((result, [i for i, _ in members]))
        return calls

    def _pack(self, rows: list[Row], num_tokens: int, to_score: np.ndarray | None = None) -> tuple:
        """The step's host arrays, and the structured-output masks if a sampling row has a
        constraint (else None when `to_score`); `to_score`: the prompt tokens to score
        (`packing.score_targets`), last."""
        key, num_rows = packing.slot_decodes_key(rows, num_tokens), row_bucket(num_tokens, self.num_slots)
        if key is not None:  # the overlap's decode calls, the same step after step: packed once, and
            # kept on the device (one engine device), so such a call copies nothing to it
            return packing.packed_once(self._slot_decodes, key, lambda: tuple(
                a if self.mesh is not None else jax.device_put(a)
                for a in pack(rows, num_tokens, num_rows, self.sampling_row)))
        packed = pack(rows, num_tokens, num_rows, self.sampling_row)
        masks = packing.grammar_masks(rows, num_rows, self.model.config.vocab_size)
        if to_score is not None:
            return (*packed, masks, to_score)
        return packed if masks is None else (*packed, masks)

    def _dispatch(self, packed: tuple[np.ndarray, ...], steps: int, sampler: Sampler = ALL,
                  verify: int = 0, prompt_k: int = 0) -> jax.Array:
        """One call of the step on packed rows (a pipeline runs it through its stages)."""
        return self._step(packed, steps, sampler, verify, prompt_k)

    def _step(self, packed: tuple[np.ndarray, ...], steps: int, sampler: Sampler = ALL, verify: int = 0,
              prompt_k: int = 0) -> jax.Array:
        return self.run_program(*self._step_arguments(packed, steps, sampler, verify, prompt_k))

    def _step_arguments(self, packed: tuple[np.ndarray, ...], steps: int,
                        sampler: Sampler = ALL, verify: int = 0, prompt_k: int = 0) -> tuple[tuple, dict]:
        by_address = (self._params_by_address is not None
                      and packed[0].shape[1] <= cpu_kernels.MAX_ROWS)
        params = self._params_by_address if by_address else self.params
        if self.lora is not None:  # the adapter pool rides in the params (cbjax/models/lora.py)
            params = {**params, "lora": self.lora.pool}
        return ((params, self.cache, self.state, *packed),
                dict(config=self.model.config, max_len=self.max_len, steps=steps, max_logprobs=self.max_logprobs,
                     attention_kernel=self.attention == "pallas", history_block=self.history_block(),
                     ops=self.ops, sampler=sampler, verify=verify, platform=self.platform, prompt_k=prompt_k))

    def run_program(self, args: tuple, static: dict) -> jax.Array:
        """Run the step program of these arguments (`_step_arguments`): the cache and state advance."""
        out, self.cache, self.state, *expert_tokens = self._program(args, static)(*args)
        if expert_tokens:  # a mixture of experts: its routing, left on the device until a round records
            self._expert_tokens.append(expert_tokens[0])
            if len(self._expert_tokens) > 64:  # nothing recorded them (the engine driven directly): fold
                self._expert_tokens = [sum(self._expert_tokens[1:], self._expert_tokens[0])]
        return out

    def _program(self, args: tuple, static: dict, wait: bool = False):
        """The compiled step for these arguments (`StepPrograms.get`), by `warmup` for the programs it
        lists; a program already compiled is one dict lookup here (a step's host time)."""
        key = (tuple(getattr(a, "shape", None) for a in args[3:]), static["steps"], static["verify"],
               static.get("prompt_k", 0), static["sampler"])  # program_key
        # Only a GPU's narrower variants compile in the background (step_programs.py).
        return self.compiled.ready.get(key) or self.compiled.get(args, static, wait or not self.samplers.specializes)

    def padding_arguments(self, num_tokens: int, steps: int, sampler: Sampler = ALL,
                          masks: np.ndarray | None = None, verify: int = 0) -> tuple[tuple, dict]:
        """The arguments of one step program over padding rows (they name no slot), as it is
        compiled ahead of time or lowered for another platform."""
        packed = self._pack([], num_tokens)
        return self._step_arguments(packed if masks is None else (*packed, masks), steps, sampler, verify)

    def compile_program(self, num_tokens: int, steps: int, sampler: Sampler = ALL) -> None:
        """Compile one program ahead of time (a narrower sampler variant than ALL: in the background)."""
        self._program(*self.padding_arguments(num_tokens, steps, sampler), wait=sampler == ALL)

    def compile_programs(self, progs: list[tuple], meanwhile: Callable[[], None] | None = None) -> None:
        """Compile every program (("step" or "verify", tokens bucket, steps)) on threads and run
        each once on padding as it is ready (rows naming no slot: XLA:CPU sets up matmuls at a
        program's first run, docs/engine.md); `meanwhile` runs here after the first run (on a
        step's output cache and state, as in serving) while the rest compile."""
        verify = {"step": 0, "verify": self.verify_positions}
        futures = self.compiled.start_compiles([self.padding_arguments(n, steps, verify=verify[kind])
                                                for kind, n, steps in progs])
        out = None
        for i, (future, (kind, num_tokens, steps)) in enumerate(zip(futures, progs)):
            future.result()
            out = self._dispatch(self._pack([], num_tokens), steps, ALL, verify[kind])
            if i == 0 and meanwhile is not None:
                meanwhile()
        jax.block_until_ready(out)

    def warmup(self, only: str | None = None) -> int:
        """Compile every program up front (`warmup.warm_up`), on a GPU after tuning its Pallas
        kernels' launches on its shapes (`kernel_tuning.tune_kernels`: read from the cache after
        the first start); returns the number of model programs."""
        if kernel_tuning.wanted(self):
            self.kernel_launches = kernel_tuning.tune_kernels(self)
        return warm_up(self, only)

    def reset(self) -> None:
        """Drop every sequence: all slots free and inactive."""
        self.cache, self.state = init_cache_and_state(self.model.config, self.config, kv_dtype(self.model, self.config),
                                                      self.mesh)
        self._tables = None
        self.samplers.reset()

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

    def copy_kv(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy KV (source, destination): pages of a paged cache, whole slots of the slot cache
        (forks of a sibling's prompt). Padded to a power of two, so programs stay few."""
        src, dst = packing.copy_pairs(copies)
        self.cache = programs.copy_kv(self.cache, self.put(src), self.put(dst))

    def move_kv(self, ops: list) -> None:
        """Run a round's moves between the cache and its host tier (`HostKV.apply`)."""
        self.host_kv.apply(self, ops)

    def load_adapter(self, slot: int, adapter) -> None:
        """Write a LoRA adapter (a host `peft.Adapter`) into the pool's `slot` (`DeviceAdapters.load`)."""
        self.lora.load(slot, adapter)

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
