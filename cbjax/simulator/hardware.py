"""Named accelerators and model shapes for the simulator.

Peak numbers are the vendors' dense bf16 figures and HBM bandwidths. A step rarely
reaches them: `compute_efficiency` and `bandwidth_efficiency` are the fractions we
assume a well-written step reaches (roughly what decode kernels and large GEMMs get on
these parts); `call_overhead_s` is the fixed cost of one device call (launches and
the host loop around it). They are assumptions, printed with every simulated run;
calibrate against measured runs (cost_model.CalibratedCost) where a device is at hand.
"""

from __future__ import annotations

import dataclasses

from cbjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes_per_s: float
    peak_flops: float  # dense bf16
    memory_bytes: float
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    call_overhead_s: float = 100e-6

    def kv_budget(self, weight_bytes: float, reserve_fraction: float = 0.1) -> int:
        """Bytes left for the KV cache after the weights and a reserve for activations."""
        return int(self.memory_bytes * (1.0 - reserve_fraction) - weight_bytes)


GB = 1e9
ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("H100 SXM 80GB", 3.35e12, 989e12, 80 * GB),
    "h200": Accelerator("H200 141GB", 4.8e12, 989e12, 141 * GB),
    "a100-40gb": Accelerator("A100 SXM 40GB", 1.555e12, 312e12, 40 * GB),
    "a100-80gb": Accelerator("A100 SXM 80GB", 2.039e12, 312e12, 80 * GB),
    "tpu-v5e": Accelerator("TPU v5e", 0.819e12, 197e12, 16 * GB),
}


def _llama(**kw) -> ModelConfig:
    return ModelConfig(model_type="llama", max_position_embeddings=4096, norm_eps=1e-5, bos_token_id=1,
                       eos_token_ids=(2,), **kw)


# Shapes only: the simulator never needs their weights.
MODEL_SHAPES: dict[str, ModelConfig] = {
    # The Anyscale study's model: OPT-13B (MHA, GELU MLP of 4x width, learned positions).
    "opt-13b": ModelConfig(model_type="gpt2", vocab_size=50272, hidden_size=5120, num_layers=40, num_heads=40,
                           num_kv_heads=40, head_dim=128, intermediate_size=20480, max_position_embeddings=2048,
                           norm_eps=1e-5, position_embedding="learned", tie_embeddings=True, qkv_bias=True,
                           o_bias=True, mlp_bias=True, bos_token_id=2, eos_token_ids=(2,)),
    "llama2-13b": _llama(vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                         head_dim=128, intermediate_size=13824),
    "llama3-8b": _llama(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336),
    "llama3.2-1b": _llama(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                          head_dim=64, intermediate_size=8192, tie_embeddings=True),
}


def matmul_params(config: ModelConfig) -> int:
    """Weights every token multiplies through: the layers and the LM head (the embedding
    lookup reads one row)."""
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (config.num_heads * 2 + config.num_kv_heads * 2)
    mlp_matrices = 2 if config.model_type == "gpt2" else 3
    per_layer = attention + mlp_matrices * h * config.intermediate_size
    return config.num_layers * per_layer + config.vocab_size * h


def weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    embeddings = 0 if config.tie_embeddings else config.vocab_size * config.hidden_size
    return (matmul_params(config) + embeddings) * dtype_bytes


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes
