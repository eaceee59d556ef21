"""`EngineArgs`: every engine knob in one dataclass, documented and checked once.

`LLM(model, **kwargs)` builds one from its keyword arguments; the server's and the
experiments' absl flags are defined from its fields (`define_flags`) and read back
into one (`from_flags`), so a knob's name, default, bounds and help live here only.
"""

from __future__ import annotations

import dataclasses
import os

from cbjax import checks, knobs, shipped_predictors
from cbjax.knobs import knob, like
from cbjax.models.fusion import FUSE_CHOICES
from cbjax.models.quant import QUANTIZATIONS
from cbjax.runtime.engine import EngineConfig
from cbjax.scheduling import SchedulerConfig
from cbjax.scheduling.speculation import LENGTH_POLICIES, METHODS
from cbjax.simulator.hardware import LINKS

DTYPES = ("float32", "bfloat16", "float16")
SIM_WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "fp8", "int8")
SIM_KV_DTYPES = ("float32", "bfloat16", "float16", "fp8")


@dataclasses.dataclass
class SchedulingKnobs:
    """What the scheduler decides (cbjax/scheduling/): the policy, its knobs, the merge mode."""

    policy: str = like(SchedulerConfig, "policy")
    num_slots: int = like(SchedulerConfig, "num_slots")
    max_seq_len: int = like(EngineConfig, "max_seq_len")
    batch_size: int = like(SchedulerConfig, "batch_size")
    window_ms: float = like(SchedulerConfig, "window_ms")
    refill_interval: int = like(SchedulerConfig, "refill_interval")
    waiting_served_ratio: float = like(SchedulerConfig, "waiting_served_ratio")
    max_waiting_steps: int = like(SchedulerConfig, "max_waiting_steps")
    max_prefill_tokens: int = like(SchedulerConfig, "max_prefill_tokens")
    ordering: str = like(SchedulerConfig, "ordering")
    score_wait: float = like(SchedulerConfig, "score_wait")
    score_short: float = like(SchedulerConfig, "score_short")
    score_priority: float = like(SchedulerConfig, "score_priority")
    length_predictor: str = knob(None, "Output-length predictor for ordering=sjf/score: a checkpoint "
                                 "directory, or the name of one cbjax ships (smollm2-135m), made for this model "
                                 "(experiments/studies/train_length_predictor.py). Default: "
                                 "requests' max_tokens.")
    priority_preemption: bool = like(SchedulerConfig, "priority_preemption")
    length_aware: bool = like(SchedulerConfig, "length_aware")
    decode_steps: int = like(SchedulerConfig, "decode_steps")
    overlap: bool = knob(True, "Host/device overlap: when nothing waits to be admitted, dispatch the next "
                         "decode call before recording the one in flight.")
    merge_mode: str = like(SchedulerConfig, "merge_mode")
    max_num_batched_tokens: int = like(SchedulerConfig, "max_num_batched_tokens")


@dataclasses.dataclass
class DeviceKnobs:
    """How the device runs the steps (cbjax/runtime/): buckets, dtypes, the KV cache, the kernels."""

    prefill_floor: int = like(EngineConfig, "prefill_floor")
    token_bucket_steps: int = like(EngineConfig, "token_bucket_steps")
    max_step_tokens: int = like(EngineConfig, "max_step_tokens")
    min_step_tokens: int = like(EngineConfig, "min_step_tokens")
    dtype: str = knob("float32", "Parameter and KV-cache dtype.", DTYPES)
    quantization: str = knob("none", "Weight-only quantization of every matmul's weights at load: none, int8 "
                             "or fp8 (e4m3; GPUs with fp8 dots), each with a scale per group of 128 inputs, or "
                             "gguf (a .gguf file's own blocks, kept as they are).", QUANTIZATIONS)
    seed: int = knob(0, "Seed of the sampling noise of requests without their own seed.", lower=0,
                     upper=2 ** 63 - 1)
    kv_cache_dtype: str = like(EngineConfig, "kv_cache_dtype")
    kv_cache: str = like(EngineConfig, "kv_cache")
    kv_cache_bytes: int = knob(None, "KV-cache memory budget in bytes; sizes num_slots (slots) or num_pages "
                               "(paged) from it.", lower=1, upper=2 ** 62)
    page_size: int = like(EngineConfig, "page_size")
    num_pages: int = like(EngineConfig, "num_pages")
    enable_prefix_caching: bool = knob(False, "Share cached prompt pages between requests (paged cache).")
    host_kv_cache_bytes: int = knob(0, "Host memory for the KV cache's second tier, in bytes (0: none): "
                                    "swapped-out requests (preemption_mode=swap) and, paged with prefix "
                                    "caching, prefix pages evicted from the device.", lower=0, upper=2 ** 62)
    preemption_mode: str = like(SchedulerConfig, "preemption_mode")
    attention: str = like(EngineConfig, "attention")
    cpu_kernels: str = like(EngineConfig, "cpu_kernels")
    quantized_matmul: str = like(EngineConfig, "quantized_matmul")
    kernel_tuning: str = like(EngineConfig, "kernel_tuning")
    fuse_projections: str = knob("auto", "One matmul for q/k/v and one for the MLP's gate/up (fused weights): auto "
                                 "(on a GPU or TPU without tensor parallelism), on or off.", FUSE_CHOICES)
    max_logprobs: int = like(EngineConfig, "max_logprobs")
    expert_capacity_factor: float = knob(None, "Mixture of experts: an expert takes at most ceil(factor x tokens "
                                         "x top_k / experts) of a step's tokens, the rest dropped (their share of "
                                         "that expert is zero); default none dropped.", lower=0.0,
                                         low_open=True)


@dataclasses.dataclass
class ScaleKnobs:
    """Where the engine runs (cbjax/runtime/scale/sharding.py, pipeline.py, cbjax/core/disaggregation.py,
    cbjax/simulator/): several devices, several instances, or a simulated accelerator."""

    tensor_parallel: int = knob(1, "Shard params and KV cache over this many devices.", lower=1)
    expert_parallel: int = knob(1, "Mixture of experts: spread the experts over this many devices (each holding "
                                "num_experts / expert_parallel of them; tokens move by all-to-all); the engine "
                                "spans expert_parallel x tensor_parallel devices, attention replicated across the "
                                "expert-parallel ones (docs/moe.md).", lower=1)
    pipeline_stages: int = knob(1, "Split the layers over this many devices instead.", lower=1)
    micro_batches: int = knob(1, "Pipeline: decode the slots in this many groups.", lower=1)
    # Prefill/decode disaggregation (cbjax/core/disaggregation.py)
    prefill_instances: int = knob(0, "Disaggregate: this many prefill-only instances (0: every instance "
                                  "prefills and decodes).", lower=0)
    decode_instances: int = knob(1, "Disaggregate: this many decode-only instances.", lower=1)
    prefill_tensor_parallel: int = knob(None, "Disaggregate: devices per prefill instance (default "
                                        "tensor_parallel).", lower=1)
    decode_tensor_parallel: int = knob(None, "Disaggregate: devices per decode instance (default "
                                       "tensor_parallel).", lower=1)
    kv_link: str = knob(None, "Disaggregate, simulated: the link a KV move crosses (default: the accelerator's).",
                        tuple(LINKS))
    # Simulation only (cbjax/simulator/): dtypes this engine does not run
    weight_dtype: str = knob(None, "Simulated weight dtype (default: dtype); fp8 runs on fp8 tensor cores, int8 "
                             "is weight-only.", SIM_WEIGHT_DTYPES)
    kv_dtype: str = knob(None, "Simulated KV-cache dtype (default: the weight dtype).", SIM_KV_DTYPES)


@dataclasses.dataclass
class SpeculationKnobs:
    """Speculative decoding (cbjax/scheduling/speculation.py, cbjax/runtime/traced/speculative.py)."""

    speculative_method: str = knob("none", "Speculative decoding: none, ngram (prompt lookup: the tokens that "
                                   "followed the latest earlier occurrence of a request's last n tokens) or draft "
                                   "(a smaller model's greedy tokens: speculative_model).", METHODS)
    speculative_model: str = knob(None, "speculative_method=draft: the draft model (preset, Hugging Face directory, "
                                  ".gguf or orbax), with the target's vocabulary.")
    num_speculative_tokens: int = like(SchedulerConfig, "num_speculative_tokens", default=4, lower=1,
                                help="Speculation: the most tokens proposed per request and step.")
    speculative_length: str = knob("adaptive", "Speculation: fixed (num_speculative_tokens every step) or adaptive "
                                   "(each step's length, 0 included, from the measured acceptance and step cost: "
                                   "SmartSpec's goodput).", LENGTH_POLICIES)
    speculative_ngram_min: int = knob(2, "ngram speculation: the shortest suffix matched.", lower=1)
    speculative_ngram_max: int = knob(4, "ngram speculation: the longest suffix matched.", lower=1)
    simulated_acceptance: float = knob(0.7, "Simulated speculation: the probability that each proposed token is "
                                       "accepted (the simulator has no real tokens to compare).", lower=0.0,
                                       upper=1.0)


@dataclasses.dataclass
class LoraKnobs:
    """Many LoRA adapters in one batch (cbjax/models/lora.py, cbjax/scheduling/adapter_slots.py)."""

    enable_lora: bool = like(EngineConfig, "enable_lora")
    max_loras: int = like(EngineConfig, "max_loras")
    max_lora_rank: int = like(EngineConfig, "max_lora_rank")
    lora_target_modules: str = like(EngineConfig, "lora_target_modules")
    max_cpu_loras: int = knob(None, "LoRA: adapters kept in host memory behind the device's (read from disk again "
                              "past them); default max_loras.", lower=1)
    lora_max_bypass: int = knob(16, "LoRA admission: how many later requests may start past one whose adapter "
                                "waits for a device slot, before admission waits for it.", lower=0)
    lora_modules: str = knob(None, "LoRA adapters loaded at start, name=path,... (enable_lora); requests name one "
                             "by lora= (the server: by model).")


@dataclasses.dataclass
class EngineArgs(LoraKnobs, SpeculationKnobs, ScaleKnobs, DeviceKnobs, SchedulingKnobs):
    """Every knob (the groups above, by job), checked once here; the scheduler's and the
    engine's own configs derived from them."""

    def __post_init__(self):
        knobs.check(self)
        if self.merge_mode in ("fused", "chunked") and self.max_num_batched_tokens is None:
            # Sarathi-style budget for chunks; a whole longest prompt beside every decode for fused.
            self.max_num_batched_tokens = (max(256, 2 * self.num_slots) if self.merge_mode == "chunked"
                                           else self.max_seq_len + self.num_slots)
        # Both configs check their cross-knob rules before any model loads, so a bad one fails fast.
        self.scheduler_config()
        self.engine_config()
        if self.length_predictor is not None:
            if not isinstance(self.length_predictor, (str, os.PathLike)):
                raise ValueError(f"length_predictor must be a checkpoint directory, got {self.length_predictor!r}")
            if not os.path.isdir(shipped_predictors.predictor_dir(self.length_predictor)):
                raise FileNotFoundError(f"length_predictor: no checkpoint directory at {self.length_predictor!r} "
                                        f"(shipped: {', '.join(shipped_predictors.shipped())})")
        if self.pipeline_stages > 1 and self.tensor_parallel > 1:
            raise ValueError("pipeline stages and tensor parallelism do not combine yet: choose one")
        check_disaggregation(self)
        if self.expert_parallel > 1 and (self.pipeline_stages > 1 or self.prefill_instances):
            raise ValueError("expert_parallel does not combine with pipeline stages or disaggregated instances yet")
        check_host_tier(self)
        check_speculation(self)
        check_lora(self)

    def scheduler_config(self, num_slots: int | None = None) -> SchedulerConfig:
        return SchedulerConfig(
            num_slots=self.num_slots if num_slots is None else num_slots, merge_mode=self.merge_mode,
            max_num_batched_tokens=self.max_num_batched_tokens, policy=self.policy, batch_size=self.batch_size,
            window_ms=self.window_ms, refill_interval=self.refill_interval,
            waiting_served_ratio=self.waiting_served_ratio, max_waiting_steps=self.max_waiting_steps,
            max_prefill_tokens=self.max_prefill_tokens, ordering=self.ordering, length_aware=self.length_aware,
            decode_steps=self.decode_steps, score_wait=self.score_wait, score_short=self.score_short,
            score_priority=self.score_priority, priority_preemption=self.priority_preemption,
            preemption_mode=self.preemption_mode, num_speculative_tokens=self.speculation_tokens)

    def engine_config(self, num_slots: int | None = None, num_pages: int | None = None) -> EngineConfig:
        return EngineConfig(
            num_slots=self.num_slots if num_slots is None else num_slots,
            num_pages=self.num_pages if num_pages is None else num_pages, max_seq_len=self.max_seq_len,
            prefill_floor=self.prefill_floor, token_bucket_steps=self.token_bucket_steps,
            decode_steps=self.decode_steps, kv_cache=self.kv_cache,
            page_size=self.page_size, attention=self.attention, merge_mode=self.merge_mode,
            max_num_batched_tokens=self.max_num_batched_tokens, cpu_kernels=self.cpu_kernels,
            quantized_matmul=self.quantized_matmul, kernel_tuning=self.kernel_tuning,
            kv_cache_dtype=self.kv_cache_dtype,
            max_logprobs=self.max_logprobs, max_step_tokens=self.max_step_tokens,
            min_step_tokens=self.min_step_tokens, num_speculative_tokens=self.speculation_tokens,
            enable_lora=self.enable_lora, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
            lora_target_modules=self.lora_target_modules)

    def lora_paths(self) -> dict[str, str]:
        """`lora_modules` as {name: path}."""
        out = {}
        for item in (self.lora_modules or "").split(","):
            if not item.strip():
                continue
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise checks.FieldError(f"lora_modules: {item!r} is not name=path", "lora_modules")
            if name.strip() in out:
                raise checks.FieldError(f"lora_modules: {name.strip()!r} named twice", "lora_modules")
            out[name.strip()] = path.strip()
        return out

    @property
    def speculation_tokens(self) -> int:
        """The most tokens proposed per request and step; 0 without speculation."""
        return self.num_speculative_tokens if self.speculative_method != "none" else 0

    # ------------------------------------------------------------- flags
    @classmethod
    def define_flags(cls, names=None, **defaults) -> list[str]:
        """Define an absl flag per field in `names` (default: all), with the field's help,
        choices and bounds; `defaults` overrides a field's default. Returns the names."""
        from absl import flags

        fields = {f.name: f for f in dataclasses.fields(cls)}
        names = list(fields) if names is None else list(names)
        for name in names:
            f, meta = fields[name], fields[name].metadata
            default = defaults.get(name, f.default)
            kind = (f.type if isinstance(f.type, str) else f.type.__name__).split(" |")[0]
            if meta["choices"]:
                flags.DEFINE_enum(name, default, list(meta["choices"]), meta["help"])
            elif kind == "bool":
                flags.DEFINE_bool(name, default, meta["help"])
            elif kind == "str":
                flags.DEFINE_string(name, default, meta["help"])
            elif kind == "float":
                flags.DEFINE_float(name, default, meta["help"], lower_bound=meta["lower"], upper_bound=meta["upper"])
            else:
                flags.DEFINE_integer(name, default, meta["help"], lower_bound=meta["lower"], upper_bound=meta["upper"])
        return names

    @classmethod
    def from_flags(cls, names, **overrides) -> "EngineArgs":
        from absl import flags

        return cls(**{**{n: flags.FLAGS[n].value for n in names}, **overrides})

    @staticmethod
    def flags_argv(names) -> list[str]:
        """The flags in `names` as command-line arguments (to start a server with them)."""
        from absl import flags

        values = {n: flags.FLAGS[n].value for n in names}
        return [f"--{'' if v else 'no'}{n}" if isinstance(v, bool) else f"--{n}={v}"
                for n, v in values.items() if v is not None]


def check_disaggregation(args: EngineArgs) -> None:
    """Refuse (ValueError) disaggregation knobs that do not combine."""
    if not args.prefill_instances:
        return
    if args.merge_mode != "prefill_first" or args.policy != "continuous":
        raise ValueError("disaggregated instances run policy=continuous, merge_mode=prefill_first (each side "
                         f"does one kind of work), got policy={args.policy!r}, merge_mode={args.merge_mode!r}")
    if args.pipeline_stages > 1:
        raise ValueError("disaggregation and pipeline stages do not combine: choose one")

def check_host_tier(args: EngineArgs) -> None:
    """Refuse (ValueError) a host tier with nothing to hold, or on a layout that keeps none."""
    if args.preemption_mode == "swap":
        if not args.host_kv_cache_bytes:
            raise ValueError("preemption_mode='swap' needs host memory to swap to: set host_kv_cache_bytes > 0")
        if args.pipeline_stages > 1 or args.prefill_instances:
            raise ValueError("preemption_mode='swap' needs a cache layout one engine gathers and restores: "
                             "not pipeline stages nor disaggregated instances (use recompute)")
    elif args.host_kv_cache_bytes and not (args.enable_prefix_caching and args.kv_cache == "paged"):
        raise ValueError("host_kv_cache_bytes has nothing to hold: set preemption_mode='swap', or "
                         "kv_cache='paged' with enable_prefix_caching (prefix pages behind the device's)")
    if args.host_kv_cache_bytes and args.pipeline_stages > 1:
        raise ValueError("host_kv_cache_bytes: pipeline stages keep no host tier (their caches are split by layer)")

def check_speculation(args: EngineArgs) -> None:
    """Refuse (ValueError) speculative decoding where its verification does not run yet."""
    if args.speculative_ngram_max < args.speculative_ngram_min:
        raise checks.FieldError(f"speculative_ngram_max must be at least speculative_ngram_min "
                                f"({args.speculative_ngram_min}), got {args.speculative_ngram_max}",
                                "speculative_ngram_max")
    if args.speculative_method != "none" and (args.pipeline_stages > 1 or args.prefill_instances):
        raise ValueError("speculative decoding verifies in one engine's step: not with pipeline stages nor "
                         "disaggregated instances yet")
    if args.speculative_method == "draft" and not args.speculative_model:
        raise ValueError("speculative_method='draft' needs speculative_model: the draft to load")
    if args.speculative_model and args.speculative_method != "draft":
        raise ValueError(f"speculative_model is the draft of speculative_method='draft' (got "
                         f"{args.speculative_method!r})")
    if args.speculative_method == "draft" and (args.tensor_parallel > 1 or args.expert_parallel > 1):
        raise ValueError("speculative_method='draft' runs its draft on one device: not with tensor_parallel or "
                         "expert_parallel yet")


def check_lora(args: EngineArgs) -> None:
    """Refuse (ValueError) LoRA knobs that do not combine."""
    if not args.enable_lora:
        if args.lora_modules:
            raise checks.FieldError("lora_modules needs enable_lora=True", "lora_modules")
        return
    args.lora_paths()
    if args.max_cpu_loras is None:
        args.max_cpu_loras = args.max_loras
    if args.max_cpu_loras < args.max_loras:
        raise checks.FieldError(f"max_cpu_loras ({args.max_cpu_loras}) must be at least max_loras ({args.max_loras})",
                                "max_cpu_loras")
    if args.pipeline_stages > 1 or args.prefill_instances:
        raise ValueError("enable_lora runs the adapters in one engine's step: not with pipeline stages nor "
                         "disaggregated instances yet")
