"""`EngineConfig`, the device engine's knobs (checked once), and the length buckets its
programs are compiled for."""

from __future__ import annotations

import dataclasses

from cbjax import checks, knobs
from cbjax.knobs import knob, like
from cbjax.models.kv_cache import KV_DTYPES
from cbjax.models.lora import MODULES
from cbjax.scheduling.config import SchedulerConfig


CPU_KERNEL_CHOICES = ("auto", "on", "off")
QUANTIZED_MATMUL_CHOICES = ("auto", "pallas", "xla")
KERNEL_TUNING_CHOICES = ("auto", "off")
ATTENTION_CHOICES = ("auto", "reference", "pallas")
# A step's default token budget, whatever max_seq_len is: prompts longer than it prefill over
# several calls (exactly), and the programs stay 10 on a CPU, 8 on an accelerator (tpu-
# inference keeps about ten, after its users named start-up compile time their first
# complaint). Every call reads all the weights once: SmolLM2's LLM.generate of 8 and 32
# prompts of 64 tokens ran 6% and 2% slower at 256 than at 512 on 2 cores. An accelerator
# takes bigger steps still (vLLM's online default is 2048).
DEFAULT_STEP_TOKENS = {"cpu": 512, "accelerator": 2048}
# A step's smallest token bucket. On a CPU a decode step's time grows with its rows from the
# first (1, 2, 4, ... all pay off). On an accelerator a step of up to ~100 tokens costs one
# read of the weights whatever its rows: buckets below 16 would only add programs to trace
# and compile at start-up (each a few seconds for an 8B model's 32 layers).
DEFAULT_MIN_STEP_TOKENS = {"cpu": 1, "accelerator": 16}


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


@dataclasses.dataclass
class EngineConfig:
    """The device engine's knobs, each declared here once unless the scheduler's config
    declares it (`EngineArgs` takes them from both)."""

    num_slots: int = like(SchedulerConfig, "num_slots")
    max_seq_len: int = knob(512, "Prompt plus output tokens per request (the cache's length).", lower=2)
    prefill_floor: int = knob(16, "Smallest token bucket of a step that holds prompt tokens.", lower=1)
    token_bucket_steps: int = knob(1, "Token buckets per doubling from prefill_floor on (a power of two): 1 = "
                                   "powers of two; 2 adds 24, 48, 96, ...: a prompt pads to at most 1.33x its "
                                   "length instead of 2x, at one more program per doubling.", lower=1)
    decode_steps: int = like(SchedulerConfig, "decode_steps")
    max_stop_tokens: int = knob(16, "Stop token ids per request the programs hold.", lower=1)
    kv_cache: str = knob("slots", "KV-cache layout: slots (one row per sequence) or paged.", ("slots", "paged"))
    page_size: int = knob(16, "Tokens per page (paged cache).", lower=1)
    num_pages: int | None = knob(None, "Pages in the paged cache (default: num_slots x max_seq_len worth).",
                                 lower=1)
    # "pallas" runs the kernels of pallas_kernels/ragged_paged_attention: Triton on a GPU, Mosaic
    # on a TPU, interpret mode on a CPU (`engine_choices.choose_attention`).
    attention: str = knob("auto", "Attention: auto (the Pallas kernels on a GPU or TPU, the reference path and "
                          "the C++ kernels on a CPU), reference (pure JAX) or pallas (the ragged kernels, over "
                          "either cache layout).", ATTENTION_CHOICES)
    merge_mode: str = like(SchedulerConfig, "merge_mode")
    max_num_batched_tokens: int | None = like(SchedulerConfig, "max_num_batched_tokens")
    # A round's rows beyond the largest bucket go in further calls, a long prompt chunk split
    # across them.
    max_step_tokens: int | None = knob(None, "Most tokens in one device step, its largest token bucket (longer "
                                       "prompts prefill over several steps); default max_num_batched_tokens, "
                                       "else 512 on a CPU, 2048 on an accelerator.", lower=1)
    min_step_tokens: int | None = knob(None, "Least tokens in one device step, its smallest token bucket (fewer "
                                       "rows pad up to it); default 1 on a CPU, 16 on an accelerator, where a "
                                       "step that small costs one read of the weights whatever its rows.", lower=1)
    # The kernels of cbjax/runtime/cpu/kernels.py.
    cpu_kernels: str = knob("auto", "Decode-sized f32 matmuls and one-token attention through C++ kernels: auto "
                            "(on a single-device CPU engine when a C++ compiler builds them), on or off.",
                            CPU_KERNEL_CHOICES)
    # runtime/engine_ops.py; the kernel is pallas_kernels/decode_matmul.
    quantized_matmul: str = knob("auto", "Decode-sized products (up to 64 rows): auto (on one GPU the Pallas "
                                 "kernel for int8/fp8 weights and for bf16 ones where kernel_tuning found it "
                                 "faster, the C++ kernels on a CPU where cpu_kernels takes them, else XLA's dot), "
                                 "pallas (the kernel for every product it takes; on a CPU 8-bit ones, "
                                 "interpreted) or xla.", QUANTIZED_MATMUL_CHOICES)
    # runtime/compiled/kernel_tuning.py.
    kernel_tuning: str = knob("auto", "The Pallas kernels' launch settings on a GPU: auto (timed at warm-up on the "
                              "engine's shapes, cached on disk by device kind, JAX version and shape) or off "
                              "(their defaults).", KERNEL_TUNING_CHOICES)
    # The 8-bit formats (cbjax/models/kv_cache.py) keep a float32 scale per position and head.
    kv_cache_dtype: str = knob("auto", "KV-cache storage: auto (dtype); float16 or bfloat16 (half of float32's "
                               "bytes: the CPU kernels read float16); int8 or fp8 (e4m3), each 8-bit vector with "
                               "a float32 scale per position and head: about twice the sequences of bf16 in "
                               "kv_cache_bytes.", KV_DTYPES)
    # vLLM's max_logprobs; computed only in steps where some row asks.
    max_logprobs: int = knob(20, "Most top-k logprobs a request may ask for; 0 compiles logprobs out.",
                             lower=0, upper=1024)
    max_logit_bias: int = knob(64, "logit_bias entries per request the programs hold.", lower=0, upper=4096)
    # A verify row is its last token and these: the programs of calls with such rows sample
    # 1 + this many positions per row (runtime/traced/speculative.py).
    num_speculative_tokens: int = like(SchedulerConfig, "num_speculative_tokens")
    # The LoRA adapter pool (cbjax/models/lora.py): slots padded to one rank, on these projections.
    enable_lora: bool = knob(False, "Serve LoRA adapters beside the base model (PEFT directories: LLM.load_lora, "
                             "--lora_modules), many in one batch.")
    max_loras: int = knob(4, "LoRA: adapters held on the device at once (the pool's slots), so at most this many "
                          "distinct adapters run in one round.", lower=1, upper=4096)
    max_lora_rank: int = knob(16, "LoRA: the largest adapter rank the pool holds (smaller ranks are zero-padded).",
                              lower=1, upper=1024)
    lora_target_modules: str = knob("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                    "LoRA: the projections the pool holds, comma-separated PEFT module names (each "
                                    "costs every step its adapters' reads; an adapter on another is refused).")

    def __post_init__(self):
        knobs.check(self)
        self.lora_modules()
        if self.token_bucket_steps & (self.token_bucket_steps - 1):
            raise ValueError(f"token_bucket_steps must be a power of two, got {self.token_bucket_steps}")
        if self.kv_cache == "paged":
            if self.max_seq_len % self.page_size:
                raise ValueError(f"max_seq_len ({self.max_seq_len}) must be a multiple of page_size "
                                 f"({self.page_size})")
            if self.num_pages is None:
                self.num_pages = self.num_slots * self.max_seq_len // self.page_size
            self.num_pages = checks.integer("num_pages", self.num_pages, 1)

    def lora_modules(self) -> tuple[str, ...]:
        """`lora_target_modules` as PEFT module names, checked."""
        names = tuple(m.strip() for m in str(self.lora_target_modules).split(",") if m.strip())
        bad = [m for m in names if m not in MODULES]
        if bad or not names:
            raise checks.FieldError(f"lora_target_modules: {bad or 'none'} not among {list(MODULES)}",
                                    "lora_target_modules")
        return names

    def step_tokens(self, platform: str) -> int:
        """The step's token budget on `platform` ("cpu" or anything else; see `max_step_tokens`),
        never more than one round can hold (a row per slot, none longer than `max_seq_len`):
        larger buckets would be programs that warm-up compiles and no call runs."""
        default = DEFAULT_STEP_TOKENS["cpu" if platform == "cpu" else "accelerator"]
        return min(self.max_step_tokens or self.max_num_batched_tokens or default, self.num_slots * self.max_seq_len)

    def smallest_step(self, platform: str) -> int:
        """The smallest token bucket on `platform` (see `min_step_tokens`)."""
        return self.min_step_tokens or DEFAULT_MIN_STEP_TOKENS["cpu" if platform == "cpu" else "accelerator"]
