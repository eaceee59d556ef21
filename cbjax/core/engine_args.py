"""`EngineArgs`: every engine knob in one dataclass, documented and checked once.

`LLM(model, **kwargs)` builds one from its keyword arguments; the server's and the
experiments' absl flags are defined from its fields (`define_flags`) and read back
into one (`from_flags`), so a knob's name, default, bounds and help live here only.
"""

from __future__ import annotations

import dataclasses
import os

from cbjax import checks, shipped_predictors
from cbjax.models.fusion import FUSE_CHOICES
from cbjax.models.kv_cache import KV_DTYPES
from cbjax.models.quant import QUANTIZATIONS
from cbjax.runtime.engine import ATTENTION_CHOICES, CPU_KERNEL_CHOICES, EngineConfig
from cbjax.runtime.engine_config import KERNEL_TUNING_CHOICES, QUANTIZED_MATMUL_CHOICES
from cbjax.scheduling import MERGE_MODES, ORDERINGS, POLICIES, SchedulerConfig
from cbjax.scheduling.config import PREEMPTION_MODES
from cbjax.simulator.hardware import LINKS

DTYPES = ("float32", "bfloat16", "float16")
SIM_WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "fp8", "int8")
SIM_KV_DTYPES = ("float32", "bfloat16", "float16", "fp8")


def _knob(default, help: str, choices=None, lower=None):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "lower": lower})


@dataclasses.dataclass
class SchedulingKnobs:
    """What the scheduler decides (cbjax/scheduling/): the policy, its knobs, the merge mode."""

    policy: str = _knob("continuous", "Batching policy: static, dynamic or continuous.", POLICIES)
    num_slots: int = _knob(8, "KV-cache slots: sequences decoded together.", lower=1)
    max_seq_len: int = _knob(512, "Prompt plus output tokens per request (the cache's length).", lower=2)
    batch_size: int = _knob(None, "Static/dynamic batch size (default: num_slots).", lower=1)
    window_ms: float = _knob(50.0, "Dynamic batching: wait at most this long after a batch's first arrival.",
                             lower=0.0)
    refill_interval: int = _knob(1, "Continuous: decode steps between admissions.", lower=1)
    waiting_served_ratio: float = _knob(0.0, "Continuous (TGI): waiting/running ratio at which prefills may "
                                        "interrupt decodes.", lower=0.0)
    max_waiting_steps: int = _knob(20, "Continuous (TGI): decode steps a waiting prefill waits at most.", lower=1)
    max_prefill_tokens: int = _knob(None, "Prompt tokens prefilled per round (chunked prefill); "
                                    "default whole prompts.", lower=1)
    ordering: str = _knob("fcfs", "Admission order of waiting requests: fcfs, priority (lower first), score "
                          "(note 004: wait, predicted remaining length, priority) or sjf (shortest predicted "
                          "remaining output first).", ORDERINGS)
    score_wait: float = _knob(1.0, "ordering=score: weight of each second waited (aging; 0 turns it off).",
                              lower=0.0)
    score_short: float = _knob(0.5, "ordering=score: weight of 1 / predicted remaining output tokens.", lower=0.0)
    score_priority: float = _knob(2.0, "ordering=score: weight of the priority (lower values rank higher).",
                                  lower=0.0)
    length_predictor: str = _knob(None, "Output-length predictor for ordering=sjf/score: a checkpoint "
                                  "directory, or the name of one cbjax ships (smollm2-135m), made for this model "
                                  "(experiments/studies/train_length_predictor.py). Default: "
                                  "requests' max_tokens.")
    priority_preemption: bool = _knob(True, "ordering=priority/score, continuous: a waiting request that outranks "
                                      "a running one takes its slot when none is free (recompute).")
    length_aware: bool = _knob(False, "Static/dynamic: batch requests of similar expected length.")
    decode_steps: int = _knob(1, "Decode steps per device call (the host syncs once per call).", lower=1)
    overlap: bool = _knob(True, "Host/device overlap: when nothing waits to be admitted, dispatch the next "
                          "decode call before recording the one in flight.")
    merge_mode: str = _knob("prefill_first", "How prefills meet running decodes: prefill_first, fused (Orca) "
                            "or chunked (Sarathi-Serve).", MERGE_MODES)
    max_num_batched_tokens: int = _knob(None, "Token budget of a mixed step (fused/chunked); default "
                                        "max(256, 2 x slots) chunked, max_seq_len + slots fused.", lower=1)


@dataclasses.dataclass
class DeviceKnobs:
    """How the device runs the steps (cbjax/runtime/): buckets, dtypes, the KV cache, the kernels."""

    prefill_floor: int = _knob(16, "Smallest token bucket of a step that holds prompt tokens.", lower=1)
    token_bucket_steps: int = _knob(1, "Token buckets per doubling from prefill_floor on (a power of two): 1 = "
                                    "powers of two; 2 adds 24, 48, 96, ...: a prompt pads to at most 1.33x its "
                                    "length instead of 2x, at one more program per doubling.", lower=1)
    max_step_tokens: int = _knob(None, "Most tokens in one device step, its largest token bucket (longer prompts "
                                 "prefill over several steps); default max_num_batched_tokens, else "
                                 "512 on a CPU, 2048 on an accelerator.", lower=1)
    min_step_tokens: int = _knob(None, "Least tokens in one device step, its smallest token bucket (fewer rows pad "
                                 "up to it); default 1 on a CPU, 16 on an accelerator, where a step that small "
                                 "costs one read of the weights whatever its rows.", lower=1)
    dtype: str = _knob("float32", "Parameter and KV-cache dtype.", DTYPES)
    quantization: str = _knob("none", "Weight-only quantization of every matmul's weights at load: none, int8 "
                              "or fp8 (e4m3; GPUs with fp8 dots), each with a scale per group of 128 inputs, or "
                              "gguf (a .gguf file's own blocks, kept as they are).", QUANTIZATIONS)
    seed: int = _knob(0, "Seed of the sampling noise of requests without their own seed.", lower=0)
    kv_cache_dtype: str = _knob("auto", "KV-cache storage: auto (dtype); float16 or bfloat16 (half of float32's "
                                "bytes: the CPU kernels read float16); int8 or fp8 (e4m3), each 8-bit vector with "
                                "a float32 scale per position and head: about twice the sequences of bf16 in "
                                "kv_cache_bytes.", KV_DTYPES)
    kv_cache: str = _knob("slots", "KV-cache layout: slots (one row per sequence) or paged.", ("slots", "paged"))
    kv_cache_bytes: int = _knob(None, "KV-cache memory budget in bytes; sizes num_slots (slots) or num_pages "
                                "(paged) from it.", lower=1)
    page_size: int = _knob(16, "Tokens per page (paged cache).", lower=1)
    num_pages: int = _knob(None, "Pages in the paged cache (default: num_slots x max_seq_len worth).", lower=1)
    enable_prefix_caching: bool = _knob(False, "Share cached prompt pages between requests (paged cache).")
    host_kv_cache_bytes: int = _knob(0, "Host memory for the KV cache's second tier, in bytes (0: none): "
                                     "swapped-out requests (preemption_mode=swap) and, paged with prefix "
                                     "caching, prefix pages evicted from the device.", lower=0)
    preemption_mode: str = _knob("recompute", "What a preempted decoding request keeps: recompute (its tokens "
                                 "are prefilled again) or swap (its KV and state wait in host memory, "
                                 "host_kv_cache_bytes).", PREEMPTION_MODES)
    attention: str = _knob("auto", "Attention: auto (the Pallas kernels on a GPU or TPU, the reference path and "
                           "the C++ kernels on a CPU), reference (pure JAX) or pallas (the ragged kernels, over "
                           "either cache layout).", ATTENTION_CHOICES)
    cpu_kernels: str = _knob("auto", "Decode-sized f32 matmuls and one-token attention through C++ kernels: auto "
                             "(on a single-device CPU engine when a C++ compiler builds them), on or off.",
                             CPU_KERNEL_CHOICES)
    quantized_matmul: str = _knob("auto", "Decode-sized products (up to 64 rows): auto (on one GPU the Pallas kernel "
                                  "for int8/fp8 weights and for bf16 ones where kernel_tuning found it faster, the "
                                  "C++ kernels on a CPU where cpu_kernels takes them, else XLA's dot), pallas (the "
                                  "kernel for every product it takes; on a CPU 8-bit ones, interpreted) or xla.",
                                  QUANTIZED_MATMUL_CHOICES)
    kernel_tuning: str = _knob("auto", "The Pallas kernels' launch settings on a GPU: auto (timed at warm-up on the "
                               "engine's shapes, cached on disk by device kind, JAX version and shape) or off (their "
                               "defaults).", KERNEL_TUNING_CHOICES)
    fuse_projections: str = _knob("auto", "One matmul for q/k/v and one for the MLP's gate/up (fused weights): auto "
                                  "(on a GPU or TPU without tensor parallelism), on or off.", FUSE_CHOICES)
    max_logprobs: int = _knob(20, "Most top-k logprobs a request may ask for; 0 compiles logprobs out.", lower=0)
    expert_capacity_factor: float = _knob(None, "Mixture of experts: an expert takes at most ceil(factor x tokens "
                                          "x top_k / experts) of a step's tokens, the rest dropped (their share of "
                                          "that expert is zero); default none dropped.", lower=0.0)


@dataclasses.dataclass
class ScaleKnobs:
    """Where the engine runs (cbjax/runtime/sharding.py, pipeline.py, cbjax/core/disaggregation.py,
    cbjax/simulator/): several devices, several instances, or a simulated accelerator."""

    tensor_parallel: int = _knob(1, "Shard params and KV cache over this many devices.", lower=1)
    expert_parallel: int = _knob(1, "Mixture of experts: spread the experts over this many devices (each holding "
                                 "num_experts / expert_parallel of them; tokens move by all-to-all); the engine "
                                 "spans expert_parallel x tensor_parallel devices, attention replicated across the "
                                 "expert-parallel ones (docs/moe.md).", lower=1)
    pipeline_stages: int = _knob(1, "Split the layers over this many devices instead.", lower=1)
    micro_batches: int = _knob(1, "Pipeline: decode the slots in this many groups.", lower=1)
    # Prefill/decode disaggregation (cbjax/core/disaggregation.py)
    prefill_instances: int = _knob(0, "Disaggregate: this many prefill-only instances (0: every instance "
                                   "prefills and decodes).", lower=0)
    decode_instances: int = _knob(1, "Disaggregate: this many decode-only instances.", lower=1)
    prefill_tensor_parallel: int = _knob(None, "Disaggregate: devices per prefill instance (default "
                                         "tensor_parallel).", lower=1)
    decode_tensor_parallel: int = _knob(None, "Disaggregate: devices per decode instance (default "
                                        "tensor_parallel).", lower=1)
    kv_link: str = _knob(None, "Disaggregate, simulated: the link a KV move crosses (default: the accelerator's).",
                         tuple(LINKS))
    # Simulation only (cbjax/simulator/): dtypes this engine does not run
    weight_dtype: str = _knob(None, "Simulated weight dtype (default: dtype); fp8 runs on fp8 tensor cores, int8 "
                              "is weight-only.", SIM_WEIGHT_DTYPES)
    kv_dtype: str = _knob(None, "Simulated KV-cache dtype (default: the weight dtype).", SIM_KV_DTYPES)


@dataclasses.dataclass
class SpeculationKnobs:
    """Speculative decoding (cbjax/scheduling/speculation.py, cbjax/runtime/speculative.py)."""

    speculative_method: str = _knob("none", "Speculative decoding: none, ngram (prompt lookup: the tokens that "
                                    "followed the latest earlier occurrence of a request's last n tokens) or draft "
                                    "(a smaller model's greedy tokens: speculative_model).", ("none", "ngram", "draft"))
    speculative_model: str = _knob(None, "speculative_method=draft: the draft model (preset, Hugging Face directory, "
                                   ".gguf or orbax), with the target's vocabulary.")
    num_speculative_tokens: int = _knob(4, "Speculation: the most tokens proposed per request and step.", lower=1)
    speculative_length: str = _knob("adaptive", "Speculation: fixed (num_speculative_tokens every step) or adaptive "
                                    "(each step's length, 0 included, from the measured acceptance and step cost: "
                                    "SmartSpec's goodput).", ("fixed", "adaptive"))
    speculative_ngram_min: int = _knob(2, "ngram speculation: the shortest suffix matched.", lower=1)
    speculative_ngram_max: int = _knob(4, "ngram speculation: the longest suffix matched.", lower=1)
    simulated_acceptance: float = _knob(0.7, "Simulated speculation: the probability that each proposed token is "
                                        "accepted (the simulator has no real tokens to compare).", lower=0.0)


@dataclasses.dataclass
class EngineArgs(SpeculationKnobs, ScaleKnobs, DeviceKnobs, SchedulingKnobs):
    """Every knob (the groups above, by job), checked once here; the scheduler's and the
    engine's own configs derived from them."""

    def __post_init__(self):
        if self.merge_mode in ("fused", "chunked") and self.max_num_batched_tokens is None:
            # Sarathi-style budget for chunks; a whole longest prompt beside every decode for fused.
            self.max_num_batched_tokens = (max(256, 2 * self.num_slots) if self.merge_mode == "chunked"
                                           else self.max_seq_len + self.num_slots)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.fuse_projections not in FUSE_CHOICES:
            raise ValueError(f"fuse_projections must be one of {FUSE_CHOICES}, got {self.fuse_projections!r}")
        # Both configs check their knobs before any model loads, so a bad one fails fast.
        self.scheduler_config()
        self.engine_config()
        if self.kv_cache_bytes is not None:
            self.kv_cache_bytes = checks.integer("kv_cache_bytes", self.kv_cache_bytes, 1, 2 ** 62)
        self.seed = checks.integer("seed", self.seed, 0, 2 ** 63 - 1)
        for name in ("tensor_parallel", "expert_parallel", "pipeline_stages", "micro_batches"):
            setattr(self, name, checks.integer(name, getattr(self, name), 1))
        if self.expert_capacity_factor is not None:
            self.expert_capacity_factor = checks.real("expert_capacity_factor", self.expert_capacity_factor,
                                                      0.0, low_open=True)
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
        for name, allowed in (("weight_dtype", SIM_WEIGHT_DTYPES), ("kv_dtype", SIM_KV_DTYPES), ("kv_link", LINKS)):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

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
            min_step_tokens=self.min_step_tokens, num_speculative_tokens=self.speculation_tokens)

    @property
    def speculation_tokens(self) -> int:
        """The most tokens proposed per request and step; 0 without speculation."""
        return self.num_speculative_tokens if self.speculative_method != "none" else 0

    # ------------------------------------------------------------- flags
    @classmethod
    def define_flags(cls, names=None, **defaults) -> list[str]:
        """Define an absl flag per field in `names` (default: all), with the field's help,
        choices and lower bound; `defaults` overrides a field's default. Returns the names."""
        from absl import flags

        fields = {f.name: f for f in dataclasses.fields(cls)}
        names = list(fields) if names is None else list(names)
        for name in names:
            f, meta = fields[name], fields[name].metadata
            default = defaults.get(name, f.default)
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if meta["choices"]:
                flags.DEFINE_enum(name, default, list(meta["choices"]), meta["help"])
            elif kind == "bool":
                flags.DEFINE_bool(name, default, meta["help"])
            elif kind == "str":
                flags.DEFINE_string(name, default, meta["help"])
            elif kind == "float":
                flags.DEFINE_float(name, default, meta["help"], lower_bound=meta["lower"])
            else:
                flags.DEFINE_integer(name, default, meta["help"], lower_bound=meta["lower"])
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
    for name in ("prefill_instances", "decode_instances", "prefill_tensor_parallel", "decode_tensor_parallel"):
        if getattr(args, name) is not None:
            setattr(args, name, checks.integer(name, getattr(args, name), 0 if name == "prefill_instances" else 1))
    if not args.prefill_instances:
        return
    if args.merge_mode != "prefill_first" or args.policy != "continuous":
        raise ValueError("disaggregated instances run policy=continuous, merge_mode=prefill_first (each side "
                         f"does one kind of work), got policy={args.policy!r}, merge_mode={args.merge_mode!r}")
    if args.pipeline_stages > 1:
        raise ValueError("disaggregation and pipeline stages do not combine: choose one")

def check_host_tier(args: EngineArgs) -> None:
    """Refuse (ValueError) a host tier with nothing to hold, or on a layout that keeps none."""
    args.host_kv_cache_bytes = checks.integer("host_kv_cache_bytes", args.host_kv_cache_bytes, 0, 2 ** 62)
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
    from cbjax.scheduling.speculation import LENGTH_POLICIES, METHODS

    if args.speculative_method not in METHODS:
        raise ValueError(f"speculative_method must be one of {METHODS}, got {args.speculative_method!r}")
    if args.speculative_length not in LENGTH_POLICIES:
        raise ValueError(f"speculative_length must be one of {LENGTH_POLICIES}, got {args.speculative_length!r}")
    args.num_speculative_tokens = checks.integer("num_speculative_tokens", args.num_speculative_tokens, 1, 64)
    args.simulated_acceptance = checks.real("simulated_acceptance", args.simulated_acceptance, 0.0, 1.0)
    args.speculative_ngram_min = checks.integer("speculative_ngram_min", args.speculative_ngram_min, 1)
    args.speculative_ngram_max = checks.integer("speculative_ngram_max", args.speculative_ngram_max,
                                                args.speculative_ngram_min)
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
