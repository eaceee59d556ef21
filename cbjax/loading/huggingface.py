"""Hugging Face checkpoint directories: config.json, *.safetensors (single or sharded
index) and tokenizer files. Every failure names the file and the tensor."""

from __future__ import annotations

import json
import os
from typing import Any

from cbjax.config import ModelConfig
from cbjax.loading.model import Model, convert_tensors

# (HF tensor name pattern, our flat name, transform). `L` in our name means the
# tensor is per layer and `{i}` in the pattern captures the layer index.
_T = lambda w: w.T  # noqa: E731  GPT-2's Conv1D stores [in, out]; we store [out, in] as Linear does.
_ID = lambda w: w  # noqa: E731

_LLAMA_NAMES = [
    (r"model\.embed_tokens\.weight", "embed", _ID),
    (r"model\.norm\.weight", "final_norm/scale", _ID),
    (r"lm_head\.weight", "lm_head", _ID),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers/attn_norm/scale", _ID),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers/mlp_norm/scale", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers/wq", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers/wk", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers/wv", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers/wo", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "layers/bq", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "layers/bk", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "layers/bv", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.bias", "layers/bo", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers/q_norm", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers/k_norm", _ID),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers/w_gate", _ID),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers/w_up", _ID),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers/w_down", _ID),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.bias", "layers/b_gate", _ID),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.bias", "layers/b_up", _ID),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.bias", "layers/b_down", _ID),
]

# A mixture-of-experts layer: the router, each expert's three matrices (stacked into
# `[experts, ...]` at load: the second group is the expert's index), Qwen2-MoE's shared expert,
# and the fused `[experts, 2 * width, hidden]` gate/up layout of transformers v5's modules.
_MOE_BLOCK = r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)"
_MOE_NAMES = [
    (_MOE_BLOCK + r"\.gate\.weight", "layers/router", _ID),
    (_MOE_BLOCK + r"\.experts\.(\d+)\.(?:gate_proj|w1)\.weight", "layers/moe_w_gate", _ID),
    (_MOE_BLOCK + r"\.experts\.(\d+)\.(?:up_proj|w3)\.weight", "layers/moe_w_up", _ID),
    (_MOE_BLOCK + r"\.experts\.(\d+)\.(?:down_proj|w2)\.weight", "layers/moe_w_down", _ID),
    (_MOE_BLOCK + r"\.experts\.gate_up_proj", "layers/moe_w_gate_up", _ID),
    (_MOE_BLOCK + r"\.experts\.down_proj", "layers/moe_w_down", _ID),
    (_MOE_BLOCK + r"\.shared_expert\.gate_proj\.weight", "layers/shared_w_gate", _ID),
    (_MOE_BLOCK + r"\.shared_expert\.up_proj\.weight", "layers/shared_w_up", _ID),
    (_MOE_BLOCK + r"\.shared_expert\.down_proj\.weight", "layers/shared_w_down", _ID),
    (_MOE_BLOCK + r"\.shared_expert_gate\.weight", "layers/shared_expert_gate", _ID),
]

# GPT-2 uses Conv1D ([in, out]) and a fused c_attn that is split afterwards.
_GPT2_NAMES = [
    (r"(?:transformer\.)?wte\.weight", "embed", _ID),
    (r"(?:transformer\.)?wpe\.weight", "pos_embed", _ID),
    (r"(?:transformer\.)?ln_f\.weight", "final_norm/scale", _ID),
    (r"(?:transformer\.)?ln_f\.bias", "final_norm/bias", _ID),
    (r"lm_head\.weight", "lm_head", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.ln_1\.weight", "layers/attn_norm/scale", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.ln_1\.bias", "layers/attn_norm/bias", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.ln_2\.weight", "layers/mlp_norm/scale", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.ln_2\.bias", "layers/mlp_norm/bias", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.weight", "layers/c_attn_w", _T),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.bias", "layers/c_attn_b", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_proj\.weight", "layers/wo", _T),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_proj\.bias", "layers/bo", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_fc\.weight", "layers/w_up", _T),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_fc\.bias", "layers/b_up", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_proj\.weight", "layers/w_down", _T),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_proj\.bias", "layers/b_down", _ID),
]

def _safetensors_files(path: str) -> dict[str, str]:
    """Map tensor name -> file, from the sharded index or the single file."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index_path}: not a valid safetensors index ({e})") from e
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, shard)):
                raise FileNotFoundError(f"{index_path} names shard {shard!r}, which is missing from {path!r}")
        return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(single, framework="numpy") as f:
                return {name: single for name in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{single}: not a readable safetensors file ({e})") from e
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def load_hf_params(path: str, config: ModelConfig, dtype="float32") -> dict:
    from safetensors import SafetensorError, safe_open

    files = _safetensors_files(path)
    handles: dict[str, Any] = {}

    def loader(name):
        def load():
            file = files[name]
            try:
                if file not in handles:
                    handles[file] = safe_open(file, framework="numpy")
                return handles[file].get_tensor(name)
            except SafetensorError as e:
                raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from e
        return load

    names = _GPT2_NAMES if config.is_gpt2 else _LLAMA_NAMES + (_MOE_NAMES if config.is_moe else [])
    try:
        return convert_tensors({n: loader(n) for n in files}, config, names, dtype, lambda n: files[n])
    finally:
        handles.clear()


def load_tokenizer(path: str, **kwargs):
    """The checkpoint's tokenizer via transformers, or None when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError):
        return None


def load_hf_dir(path: str, dtype="float32", with_tokenizer: bool = True) -> Model:
    config = ModelConfig.from_hf_dir(path)
    params = load_hf_params(path, config, dtype)
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return Model(config, params, tokenizer, source=path)
