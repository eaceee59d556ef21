"""`EngineConfig`, the device engine's knobs (checked once), and the length buckets its
programs are compiled for."""

from __future__ import annotations

import dataclasses

from cbjax import checks
from cbjax.models.kv_cache import KV_DTYPES
from cbjax.scheduling.config import MERGE_MODES


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
    num_slots: int = 8
    max_seq_len: int = 512
    prefill_floor: int = 16
    # Token buckets per doubling from prefill_floor on: 1 keeps powers of two (a prompt pads to
    # up to twice its length); 2 adds the 1.5x sizes (24, 48, 96, ...: up to 1.33x, at one
    # more program per doubling). A power of two.
    token_bucket_steps: int = 1
    decode_steps: int = 1
    max_stop_tokens: int = 16
    kv_cache: str = "slots"  # or "paged"
    page_size: int = 16
    num_pages: int | None = None  # paged: pool size (default: enough for every slot at max_seq_len)
    # Attention over either cache layout: "reference" (pure JAX, everywhere), "pallas" (the ragged
    # kernels of pallas_kernels/ragged_paged_attention: Triton on a GPU, Mosaic on a TPU, interpret
    # mode on a CPU), or "auto": the kernels on a GPU or TPU, the reference path (and the C++
    # CPU kernels) on a CPU (`engine_choices.choose_attention`).
    attention: str = "auto"
    # "prefill_first": a step of prompt rows, then one of decode rows. "fused" / "chunked": one
    # step of both per round over at most `max_num_batched_tokens` tokens (runtime/step.py).
    merge_mode: str = "prefill_first"
    max_num_batched_tokens: int | None = None
    # The most tokens one step holds, its largest token bucket (so it bounds the programs): a
    # round's rows beyond it go in further calls, a long prompt chunk split across them.
    # Default: max_num_batched_tokens, else DEFAULT_STEP_TOKENS for the engine's platform.
    max_step_tokens: int | None = None
    # The least tokens a step is compiled for, its smallest token bucket (rows of fewer pad up
    # to it). Default: DEFAULT_MIN_STEP_TOKENS for the engine's platform.
    min_step_tokens: int | None = None
    # Decode-sized f32 matmuls and one-token attention reads: "auto" (the kernels of
    # cbjax/runtime/cpu/kernels.py on a single-device CPU engine when they build, else XLA),
    # "on" (those, or an error) or "off" (XLA).
    cpu_kernels: str = "auto"
    # Decode-sized products: "auto" (on one GPU the Pallas kernel of pallas_kernels/decode_matmul
    # for int8/fp8 weights and where the device's tuning chose it for float ones, XLA's dot
    # elsewhere), "pallas" (the kernel for every product it takes; on a CPU for 8-bit weights,
    # interpreted) or "xla" (runtime/engine_ops.py).
    quantized_matmul: str = "auto"
    # The Pallas kernels' launch settings: "auto" (on a GPU, timed at warm-up on the engine's own
    # shapes and cached on disk by device kind, JAX version and shape: runtime/kernel_tuning.py)
    # or "off" (the kernels' defaults).
    kernel_tuning: str = "auto"
    # The KV cache's storage: "auto" (the model's dtype), or "int8" / "fp8" (e4m3) with a float32
    # scale per position and head (cbjax/models/kv_cache.py), about half of bf16's bytes.
    kv_cache_dtype: str = "auto"
    # Logprobs: the most top-k alternatives a request may ask for (vLLM's max_logprobs); 0
    # leaves them out of every program. Computed only in steps where some row asks.
    max_logprobs: int = 20
    max_logit_bias: int = 64  # logit_bias entries per request
    # Speculative decoding: the most tokens proposed for a request per step (0: none). A verify
    # row is its last token and these: the programs of calls with such rows sample 1 + this
    # many positions per row (runtime/speculative.py).
    num_speculative_tokens: int = 0

    def __post_init__(self):
        self.num_slots = checks.integer("num_slots", self.num_slots, 1)
        self.max_seq_len = checks.integer("max_seq_len", self.max_seq_len, 2)
        for name in ("prefill_floor", "decode_steps", "max_stop_tokens", "page_size", "token_bucket_steps"):
            setattr(self, name, checks.integer(name, getattr(self, name), 1))
        if self.token_bucket_steps & (self.token_bucket_steps - 1):
            raise ValueError(f"token_bucket_steps must be a power of two, got {self.token_bucket_steps}")
        self.max_logprobs = checks.integer("max_logprobs", self.max_logprobs, 0, 1024)
        self.max_logit_bias = checks.integer("max_logit_bias", self.max_logit_bias, 0, 4096)
        self.num_speculative_tokens = checks.integer("num_speculative_tokens", self.num_speculative_tokens, 0, 64)
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}")
        if self.cpu_kernels not in CPU_KERNEL_CHOICES:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_CHOICES}, got {self.cpu_kernels!r}")
        if self.quantized_matmul not in QUANTIZED_MATMUL_CHOICES:
            raise ValueError(f"quantized_matmul must be one of {QUANTIZED_MATMUL_CHOICES}, "
                             f"got {self.quantized_matmul!r}")
        if self.kernel_tuning not in KERNEL_TUNING_CHOICES:
            raise ValueError(f"kernel_tuning must be one of {KERNEL_TUNING_CHOICES}, got {self.kernel_tuning!r}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache not in ("slots", "paged"):
            raise ValueError(f"kv_cache must be 'slots' or 'paged', got {self.kv_cache!r}")
        if self.merge_mode not in MERGE_MODES:
            raise ValueError(f"merge_mode must be one of {MERGE_MODES}, got {self.merge_mode!r}")
        if self.max_num_batched_tokens is not None:
            self.max_num_batched_tokens = checks.integer("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_step_tokens is not None:
            self.max_step_tokens = checks.integer("max_step_tokens", self.max_step_tokens, 1)
        if self.min_step_tokens is not None:
            self.min_step_tokens = checks.integer("min_step_tokens", self.min_step_tokens, 1)
        if self.kv_cache == "paged":
            if self.max_seq_len % self.page_size:
                raise ValueError(f"max_seq_len ({self.max_seq_len}) must be a multiple of page_size "
                                 f"({self.page_size})")
            if self.num_pages is None:
                self.num_pages = self.num_slots * self.max_seq_len // self.page_size
            self.num_pages = checks.integer("num_pages", self.num_pages, 1)

    def step_tokens(self, platform: str) -> int:
        """The step's token budget on `platform` ("cpu" or anything else; see `max_step_tokens`),
        never more than one round can hold (a row per slot, none longer than `max_seq_len`):
        larger buckets would be programs that warm-up compiles and no call runs."""
        default = DEFAULT_STEP_TOKENS["cpu" if platform == "cpu" else "accelerator"]
        return min(self.max_step_tokens or self.max_num_batched_tokens or default, self.num_slots * self.max_seq_len)

    def smallest_step(self, platform: str) -> int:
        """The smallest token bucket on `platform` (see `min_step_tokens`)."""
        return self.min_step_tokens or DEFAULT_MIN_STEP_TOKENS["cpu" if platform == "cpu" else "accelerator"]
