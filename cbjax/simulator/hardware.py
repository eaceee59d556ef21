"""Named accelerators, links and model shapes for the simulator.

Peaks are the vendors' dense figures (bf16/fp16 and, where the tensor cores have it,
fp8); memories are the usable GiB a device reports; links are per direction. What a
serving engine gets out of them is in `Efficiency`: the fraction of peak FLOPs its
prefill and decode matmuls reach, the fraction of HBM bandwidth it streams at, how much
of the memory time hides under the compute, and its fixed costs per forward pass, per
request in a pass and per engine call. The presets' efficiencies were fitted once on
the published measurements marked `fit` in configs/published_gpu_measurements.json
(experiments/studies/validate_simulator.py --published --fit) and frozen before the others
were compared; docs/simulator.md lists every charge with its formula and source.
"""

from __future__ import annotations

import dataclasses

from cbjax.config import ModelConfig

GB = 1e9
GiB = 2 ** 30
US = 1e-6


@dataclasses.dataclass(frozen=True)
class Link:
    """A device-to-device link: bytes per second in one direction, and the fixed latency
    of one collective or transfer over it."""
    name: str
    bytes_per_s: float
    latency_s: float

    def transfer_seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s

    def all_reduce_seconds(self, num_bytes: float, devices: int) -> float:
        """Ring all-reduce: each device sends and receives 2(n-1)/n of the message."""
        if devices <= 1:
            return 0.0
        return self.latency_s + 2.0 * (devices - 1) / devices * num_bytes / self.bytes_per_s


# Per-direction bandwidths from the vendors' documents; latencies are the small-message
# all-reduce / transfer times NCCL and the TPU runtime report (order of magnitude).
LINKS: dict[str, Link] = {
    "nvlink3": Link("NVLink 3 (A100, 600 GB/s both ways)", 300 * GB, 8 * US),
    "nvlink4": Link("NVLink 4 (H100/H200, 900 GB/s both ways)", 450 * GB, 6 * US),
    "pcie4": Link("PCIe 4.0 x16", 32 * GB, 10 * US),
    "pcie5": Link("PCIe 5.0 x16", 64 * GB, 10 * US),
    "ici-v5e": Link("TPU v5e ICI (1,600 Gbit/s per chip)", 200 * GB, 5 * US),
    "dcn": Link("Data-center network, 200 Gbit/s (25 GB/s) per host", 25 * GB, 50 * US),
    # Device <-> host memory (the KV cache's host tier): what a pinned-memory copy reaches, as
    # NVIDIA's bandwidthTest / nvbandwidth report it (about 80% of the bus's peak), and the
    # Grace Hopper chip-to-chip link.
    "pcie4-host": Link("PCIe 4.0 x16 to pinned host memory (~25 GB/s)", 25 * GB, 10 * US),
    "pcie5-host": Link("PCIe 5.0 x16 to pinned host memory (~53 GB/s)", 53 * GB, 10 * US),
    "nvlink-c2c": Link("NVLink-C2C (GH200, 900 GB/s both ways)", 450 * GB, 5 * US),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """What an engine reaches on a device (fitted; see the module docstring)."""
    # Fraction of peak FLOPs a matmul of M = tokens-per-pass rows reaches: compute x M / (M +
    # half_tokens) (GEMMs fill the tensor cores only with enough rows: a decode of a few
    # requests or a short prefill runs far below a long prefill's efficiency).
    compute: float = 0.7
    half_tokens: float = 64.0
    # ... and x K / (K + half_inner), K the per-device inner dimension of the layer's GEMMs
    # (`gemm_inner_dim`): each output tile's fixed prologue and epilogue amortize over a longer
    # K loop, so a 70B layer's K = 8192 GEMMs reach a higher share of peak than a 7B's K = 4096.
    half_inner: float = 0.0
    bandwidth: float = 0.8         # fraction of HBM bandwidth when streaming weights and KV
    overlap: float = 1.0           # 1: memory time hides fully under compute (max); 0: they add
    pass_overhead_s: float = 100 * US   # launches per forward pass (CUDA graphs make it small)
    request_overhead_s: float = 0.0     # per request per forward pass (sampling, bookkeeping)
    call_overhead_s: float = 0.0        # per engine call: the host's scheduling round
    prefill_overhead_s: float = 0.0     # per prefill call: preparing inputs, context-phase setup
    all_reduce_overhead_s: float = 0.0  # software cost of one all-reduce beyond the link (NCCL launch)
    # Times decode attention reads each KV head per step: 1 for GQA-aware kernels (TensorRT-
    # LLM's XQA, vLLM's paged attention) up to heads / KV heads when every query head reads
    # its own copy (TensorRT-LLM's masked MHA before XQA), less what the L2 cache serves.
    gqa_kv_reads: float = 1.0


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes_per_s: float
    peak_flops: float  # dense bf16 / fp16
    memory_bytes: float
    peak_flops_8bit: float = 0.0  # dense fp8 (0: no 8-bit tensor-core math; int8/fp8 weights are upcast)
    link: str = "pcie4"
    usable_memory_fraction: float = 0.9  # vLLM's gpu_memory_utilization, TRT-LLM's free-memory fraction
    efficiency: Efficiency = Efficiency()
    host_link: str = "pcie4-host"  # to host memory: the KV cache's host tier (swap, prefix pages)

    def kv_budget(self, weight_bytes: float, reserve_fraction: float | None = None, devices: int = 1) -> int:
        """Bytes left for the KV cache on `devices` of these after the weights (sharded
        over them) and the unusable share of memory (activations, workspace)."""
        usable = 1.0 - reserve_fraction if reserve_fraction is not None else self.usable_memory_fraction
        return int(devices * self.memory_bytes * usable - weight_bytes)

    def peak_for(self, dtype: str) -> float:
        """Peak FLOPs a matmul with `dtype` weights runs at: fp8 on fp8 tensor cores where
        the part has them; int8 weights are upcast (weight-only), so they save bytes only."""
        if dtype == "fp8" and self.peak_flops_8bit:
            return self.peak_flops_8bit
        return self.peak_flops / 2 if dtype == "float32" else self.peak_flops

    def with_efficiency(self, **changes) -> "Accelerator":
        return dataclasses.replace(self, efficiency=dataclasses.replace(self.efficiency, **changes))


# Fitted on the `fit` rows of configs/published_gpu_measurements.json (A100: TensorRT-LLM
# fp16 rows; H100: TensorRT-LLM fp8 rows) and frozen; the other rows only validate.
A100_ENGINE = Efficiency(compute=0.854, half_tokens=58.5, half_inner=450.0, bandwidth=0.921, overlap=0.345,
                         pass_overhead_s=97.4 * US, prefill_overhead_s=1.01e-3, all_reduce_overhead_s=10.3 * US)
H100_ENGINE = Efficiency(compute=0.588, half_tokens=72.3, half_inner=523.0, bandwidth=0.838, overlap=0.211,
                         pass_overhead_s=103 * US, prefill_overhead_s=1.33e-3, all_reduce_overhead_s=10.6 * US)

ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("H100 SXM 80GB", 3.35e12, 989e12, 80 * GiB, 1979e12, "nvlink4", efficiency=H100_ENGINE,
                        host_link="pcie5-host"),
    "h200": Accelerator("H200 141GB", 4.8e12, 989e12, 141 * GB, 1979e12, "nvlink4", efficiency=H100_ENGINE,
                        host_link="pcie5-host"),
    "a100-40gb": Accelerator("A100 SXM 40GB", 1.555e12, 312e12, 40 * GiB, 0.0, "nvlink3", efficiency=A100_ENGINE),
    "a100-80gb": Accelerator("A100 SXM 80GB", 2.039e12, 312e12, 80 * GiB, 0.0, "nvlink3", efficiency=A100_ENGINE),
    "tpu-v5e": Accelerator("TPU v5e", 0.819e12, 197e12, 16 * GiB, 394e12, "ici-v5e"),
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


def _llama(**kw) -> ModelConfig:
    kw.setdefault("max_position_embeddings", 4096)
    return ModelConfig(model_type="llama", norm_eps=1e-5, bos_token_id=1, eos_token_ids=(2,), **kw)


# Shapes only: the simulator never needs their weights.
MODEL_SHAPES: dict[str, ModelConfig] = {
    # The Anyscale study's model: OPT-13B (MHA, GELU MLP of 4x width, learned positions).
    "opt-13b": ModelConfig(model_type="gpt2", vocab_size=50272, hidden_size=5120, num_layers=40, num_heads=40,
                           num_kv_heads=40, head_dim=128, intermediate_size=20480, max_position_embeddings=2048,
                           norm_eps=1e-5, position_embedding="learned", tie_embeddings=True, qkv_bias=True,
                           o_bias=True, mlp_bias=True, bos_token_id=2, eos_token_ids=(2,)),
    "llama2-7b": _llama(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                        head_dim=128, intermediate_size=11008),
    "llama2-13b": _llama(vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                         head_dim=128, intermediate_size=13824),
    "llama2-70b": _llama(vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                         head_dim=128, intermediate_size=28672),
    # Sarathi-Serve's single-A100 model (its sliding window, 4096, is not modelled).
    "mistral-7b": _llama(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, intermediate_size=14336, max_position_embeddings=32768),
    "llama3-8b": _llama(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336),
    "llama3-70b": _llama(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                         head_dim=128, intermediate_size=28672, max_position_embeddings=8192),
    "llama3.2-1b": _llama(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                          head_dim=64, intermediate_size=8192, tie_embeddings=True),
    # Mixtures of experts (docs/moe.md) and the dense shapes they are compared with.
    # Mixtral-8x7B: 46.7B weights, 12.9B active (8 experts of 14336, top 2).
    "mixtral-8x7b": ModelConfig(model_type="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                                max_position_embeddings=32768, norm_eps=1e-5, rope_theta=1e6, bos_token_id=1,
                                eos_token_ids=(2,), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
                                norm_topk_prob=True),
    # A dense model of Mixtral's active parameters (its MLP as wide as two experts).
    "dense-12.9b": _llama(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                          head_dim=128, intermediate_size=2 * 14336, max_position_embeddings=32768),
    # Qwen3-30B-A3B: 30.5B weights, 3.3B active (128 experts of 768, top 8).
    "qwen3-30b-a3b": ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48,
                                 num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
                                 max_position_embeddings=40960, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                                 bos_token_id=None, eos_token_ids=(151645,), num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, norm_topk_prob=True),
    # Qwen2.5-3B's shape (3.1B), the dense model of about Qwen3-30B-A3B's active parameters.
    "qwen2.5-3b": ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=2048, num_layers=36, num_heads=16,
                              num_kv_heads=2, head_dim=128, intermediate_size=11008, max_position_embeddings=32768,
                              norm_eps=1e-6, rope_theta=1e6, qkv_bias=True, tie_embeddings=True, bos_token_id=None,
                              eos_token_ids=(151645,)),
}


def moe_layers(config: ModelConfig) -> int:
    """Layers whose MLP is the routed experts."""
    return sum(config.is_moe_layer(i) for i in range(config.num_layers))


def expert_params(config: ModelConfig, experts: float | None = None) -> float:
    """The routed experts' weights over every MoE layer: all of them (or `experts` per layer)."""
    per_layer = config.num_experts if experts is None else experts
    return 3 * config.hidden_size * config.moe_intermediate_size * per_layer * moe_layers(config)


def mlp_active_width(config: ModelConfig) -> float:
    """The MLP width a token multiplies through, averaged over the layers (a MoE layer: its top-k
    experts and its shared expert)."""
    if not config.is_moe:
        return config.intermediate_size
    routed = moe_layers(config)
    moe = config.num_experts_per_tok * config.moe_intermediate_size + config.shared_expert_intermediate_size
    return (routed * moe + (config.num_layers - routed) * config.intermediate_size) / config.num_layers


def matmul_params(config: ModelConfig) -> int:
    """Weights every token multiplies through: the layers and the LM head (the embedding
    lookup reads one row); of a mixture of experts, its active ones."""
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (config.num_heads * 2 + config.num_kv_heads * 2)
    mlp_matrices = 2 if config.model_type == "gpt2" else 3
    per_layer = attention + mlp_matrices * h * mlp_active_width(config)
    return int(config.num_layers * per_layer + config.vocab_size * h)


def gemm_inner_dim(config: ModelConfig, tensor_parallel: int = 1) -> float:
    """The inner (reduction) dimension K of a layer's matmuls on one device, averaged as their
    time would be (harmonic, weighted by weights): Megatron's column-parallel q/k/v, gate/up
    and LM head keep K = hidden; the row-parallel attention output and MLP down projection
    see K / tensor_parallel (a MoE layer: each expert's width)."""
    h, d, tp = config.hidden_size, config.head_dim, tensor_parallel
    width = mlp_active_width(config)
    down_k = config.moe_intermediate_size if config.is_moe else config.intermediate_size
    mlp_in = 1 if config.model_type == "gpt2" else 2  # fc, or gate and up
    at_hidden_k = h * d * (config.num_heads + config.num_kv_heads * 2) + mlp_in * h * width
    attention_out, down = h * d * config.num_heads, h * width
    weights_over_k = config.num_layers * (at_hidden_k / h + attention_out / (config.num_heads * d / tp)
                                          + down / (down_k / tp)) + config.vocab_size
    return matmul_params(config) / weights_over_k


def weight_bytes(config: ModelConfig, dtype_bytes: float) -> int:
    """Every weight: of a mixture of experts, every expert (not only the active ones)."""
    embeddings = 0 if config.tie_embeddings else config.vocab_size * config.hidden_size
    idle_experts = expert_params(config) - expert_params(config, config.num_experts_per_tok) if config.is_moe else 0
    return int((matmul_params(config) + embeddings + idle_experts) * dtype_bytes)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: float) -> int:
    return int(2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes)
