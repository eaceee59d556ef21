"""From `EngineArgs` to a running `EngineCore`: load the model, size the KV cache from its
memory budget, pick the engine (device, pipeline stages, or the simulator) and wire the
scheduler and the page allocator to it."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax

from cbjax.core.engine_args import EngineArgs
from cbjax.core.engine_core import EngineCore
from cbjax.loading import Model, huge_pages, load_model
from cbjax.models import fusion, quant
from cbjax.models.kv_cache import SlotCache, kv_capacity, kv_storage_dtype
from cbjax.runtime import kv_transfer
from cbjax.runtime.scale import sharding
from cbjax.runtime.traced.device_state import SlotState
from cbjax.runtime.engine import Engine
from cbjax.runtime.engine_choices import wants_fusion
from cbjax.runtime.engine_ops import start_cpu_kernel_build
from cbjax.scheduling import BlockManager, Scheduler
from cbjax.scheduling.adapter_slots import AdapterSlots
from cbjax.scheduling.adapter_store import AdapterStore
from cbjax.scheduling.host_tier import HostTier
from cbjax.scheduling.roles import DecodeScheduler, PrefillScheduler
from cbjax.scheduling.speculation import make_speculator


def build_core(model: str | Model, args: EngineArgs, *, clock: Callable[[], float] = time.perf_counter,
               simulate=None, devices: Sequence | None = None, mesh=None, role: str = "both"
               ) -> tuple[Model, EngineCore]:
    """`role`: "both" (colocated), or a disaggregated instance's "prefill" / "decode" (its
    scheduler, cbjax/scheduling/roles.py). `simulate`: an accelerator name, a calibration
    file or a cost model (cbjax.simulator): the engine then computes nothing and time is simulated. `mesh` / `devices` /
    `args.tensor_parallel`: a tensor-parallel mesh; `args.pipeline_stages`: layers over devices."""
    if args.pipeline_stages > 1 and mesh is not None:
        raise ValueError("pipeline stages and tensor parallelism do not combine yet: choose one")
    if (simulate is None and mesh is None and args.pipeline_stages == 1
            and (args.tensor_parallel > 1 or args.expert_parallel > 1 or devices is not None)):
        mesh = sharding.tensor_parallel_mesh(args.tensor_parallel, devices, args.expert_parallel)
    if simulate is not None and args.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype!r} runs on a device: a simulation models KV bytes "
                         "with kv_dtype (fp8 for one byte)")
    if simulate is None and (args.weight_dtype or args.kv_dtype):
        raise ValueError("weight_dtype and kv_dtype are simulated only: this engine runs dtype "
                         f"({args.dtype}); pass simulate=<accelerator> to model them")
    if simulate is not None:
        if mesh is not None or devices is not None or args.pipeline_stages > 1:
            raise ValueError("simulate runs no device: it takes no devices, mesh or pipeline_stages "
                             "(tensor_parallel is modelled)")
        from cbjax import simulator

        if not isinstance(model, Model):
            model = simulator.model_for_simulation(model, dtype=args.dtype)
        accelerator = simulate if isinstance(simulate, str) and not simulate.endswith(".json") else None
        if isinstance(simulate, str):
            simulate = simulator.load_cost_model(simulate, model.config, 2 if args.dtype != "float32" else 4,
                                                 args.tensor_parallel, args.weight_dtype, args.kv_dtype,
                                                 args.expert_parallel)
        elif args.tensor_parallel > 1 and getattr(simulate, "tensor_parallel", 1) != args.tensor_parallel:
            raise ValueError(f"tensor_parallel={args.tensor_parallel} but the cost model given to simulate "
                             f"models {getattr(simulate, 'tensor_parallel', 1)} device(s)")
        if clock is time.perf_counter:
            clock = simulator.SimClock()
    owned = not isinstance(model, Model)  # loaded here: its params are this call's to replace
    if simulate is None and owned:
        start_cpu_kernel_build(args.cpu_kernels)  # a cold start's compiler run overlaps the load
    model = model if isinstance(model, Model) else load_model(model, dtype=args.dtype,
                                                              keep_gguf_blocks=args.quantization == "gguf")
    if args.expert_capacity_factor is not None:
        if not model.config.is_moe:
            raise ValueError(f"expert_capacity_factor applies to a mixture of experts; {model.config.model_type!r} "
                             "is dense")
        model = dataclasses.replace(model, config=model.config.replace(
            expert_capacity_factor=args.expert_capacity_factor))
    if args.quantization == "gguf" and simulate is None:
        if quant.quantization_of(model.params) != "gguf":
            raise ValueError("quantization='gguf' keeps a GGUF file's blocks: pass the .gguf path, not a model "
                             "loaded without them")
        if mesh is not None or args.pipeline_stages > 1:
            raise ValueError("quantization='gguf' runs on one device (its blocks are not split yet)")
    first_device = (list(mesh.devices.flat) if mesh is not None else list(devices or jax.devices()))[0]
    if args.quantization not in ("none", "gguf") and simulate is None:
        model, owned = quantized(model, args.quantization, first_device), True
    if simulate is None and wants_fusion(args.fuse_projections, first_device.platform, args.quantization,
                                         args.tensor_parallel if mesh is None else sharding.tp_size(mesh)):
        model = dataclasses.replace(model, params=fusion.fuse_projections(model.params, release=owned))
    num_slots, num_pages = args.num_slots, args.num_pages
    if args.kv_cache_bytes is not None:  # one memory budget from which either layout sizes itself
        if simulate is None:
            kv_dtype = kv_storage_dtype(args.kv_cache_dtype, args.dtype)
        else:  # the cost model's rule: kv_dtype, else the weights', else dtype
            kv_dtype = args.kv_dtype or args.weight_dtype or args.dtype
            kv_dtype = {"fp8": "float8_e4m3fn"}.get(kv_dtype, kv_dtype)
        num_slots, num_pages = kv_capacity(model.config, args.kv_cache, args.kv_cache_bytes, args.max_seq_len,
                                           args.page_size, kv_dtype, num_slots,
                                           scaled=None if simulate is None else False)  # simulated fp8: no scales
    engine_config = args.engine_config(num_slots, num_pages)
    if simulate is not None:
        engine = simulator.SimulatedEngine(model, engine_config, simulate, clock, dtype=args.dtype)
    elif args.pipeline_stages > 1:
        from cbjax.runtime.scale.pipeline import PipelineEngine

        engine = PipelineEngine(model, engine_config, args.pipeline_stages, args.micro_batches, devices)
    else:
        engine = Engine(model, engine_config, mesh=mesh)
    host = host_tier(engine, args, simulate) if args.host_kv_cache_bytes else None
    pages = None
    if args.kv_cache == "paged":
        pages = BlockManager(engine.config.num_pages, args.page_size, args.enable_prefix_caching, host=host)
    scheduler_class = {"both": Scheduler, "prefill": PrefillScheduler, "decode": DecodeScheduler}[role]
    scheduler = scheduler_class(args.scheduler_config(num_slots), set(model.config.eos_token_ids), args.max_seq_len,
                                pages=pages, host=host)
    if args.enable_lora:
        store = AdapterStore(model.config, args.max_lora_rank, engine_config.lora_modules(), args.max_cpu_loras,
                             simulated=simulate is not None)
        scheduler.adapters = AdapterSlots(store, args.max_loras, args.lora_max_bypass)
    core = EngineCore(engine, scheduler, pages, clock, overlap=args.overlap)
    draft = None
    if simulate is not None and args.speculation_tokens:
        draft = simulated_proposer(engine, args, accelerator)
    elif args.speculative_method == "draft":
        from cbjax.core.draft import draft_proposer

        draft = draft_proposer(args.speculative_model, model, args, num_slots)
    scheduler.speculator = make_speculator(args.speculative_method, args.speculation_tokens, args.speculative_length,
                                           args.max_seq_len, args.speculative_ngram_min, args.speculative_ngram_max,
                                           draft=draft,
                                           buckets=None if simulate is not None else engine.info().token_buckets)
    if args.length_predictor is not None:
        from cbjax.models.length_predictor import LengthPredictor

        core.predict_len = LengthPredictor.load(args.length_predictor, model)
    return model, core


def simulated_proposer(engine, args: EngineArgs, accelerator: str | None):
    """Speculation in a simulation: proposals accepted with probability `simulated_acceptance`
    each; a draft model's steps (`speculative_model`, a shape) charged at its own roofline on the
    same accelerator: k decode steps of the speculating rows a round."""
    from cbjax import simulator
    from cbjax.scheduling.speculation import SimulatedProposer, check_draft_vocabulary
    from cbjax.simulator.cost_model import Call

    charge = None
    if args.speculative_method == "draft":
        if accelerator is None:
            raise ValueError("speculative_method='draft' is simulated on an accelerator's roofline: a calibration "
                             "file models the target alone")
        draft = simulator.model_for_simulation(args.speculative_model, dtype=args.dtype)
        check_draft_vocabulary(draft.config.vocab_size, engine.model.config.vocab_size)
        cost = simulator.load_cost_model(accelerator, draft.config, 2 if args.dtype != "float32" else 4, 1,
                                         args.weight_dtype, args.kv_dtype)

        def draft_steps(requests, ks):
            rows = [r for r, k in zip(requests, ks) if k > 0]
            keys = sum(r.num_tokens for r in rows)
            step = Call("decode", tokens=len(rows), attended=keys, kv_read=keys, rows=len(rows))
            engine.charge(max(ks) * cost.seconds(step))

        charge = draft_steps

    return SimulatedProposer(args.simulated_acceptance, lambda r: engine.filler_for(r.sampling), args.seed, charge)


def quantized(model: Model, mode: str, device) -> Model:
    """`model` with its matmul weights quantized to `mode` (cbjax/models/quant.py), refused
    where `device` cannot run it."""
    if mode == "fp8" and quant.fp8_refusal(device):
        raise ValueError(quant.fp8_refusal(device))
    already = quant.quantization_of(model.params)
    if already not in ("none", mode):
        raise ValueError(f"quantization={mode!r}: the model's weights are already {already}-quantized")
    params = quant.quantize_params(model.params, mode, model.config.tie_embeddings)
    return dataclasses.replace(model, params=huge_pages.on_huge_pages(params))  # on the CPU, one 2 MB-page arena


def host_tier(engine, args: EngineArgs, simulate=None) -> HostTier:
    """The host tier's accounting at the bytes the engine stores: a page at the cache's dtype
    (simulated: the cost model's KV dtype), a swapped sequence padded as `kv_transfer` gathers
    it, with its decode-state row."""
    config, c = engine.model.config, engine.config
    if simulate is not None:
        per_token = engine.kv_bytes_per_token
    else:
        per_token = SlotCache.bytes_per_slot(config, 1, engine.cache.k[0].dtype)
    state = jax.eval_shape(lambda: SlotState.init(1, c.max_stop_tokens, c.max_logit_bias, config.vocab_size))
    state_row = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    page_size = args.page_size if args.kv_cache == "paged" else 1

    def sequence_bytes(length: int) -> int:
        return per_token * kv_transfer.padded_length(length, args.max_seq_len, page_size) + state_row

    return HostTier(args.host_kv_cache_bytes, per_token * args.page_size, sequence_bytes)
