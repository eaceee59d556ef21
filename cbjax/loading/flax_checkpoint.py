"""A JAX training run's checkpoint, loaded as it is: a directory with the params saved by orbax
(`params/`), the model's Hugging Face `config.json` and the tokenizer's files (what
experiments/studies/train_tiny.py writes).

The layouts read, for Llama-family models (the param names each accepts are in `_NAMES`):
- flax NNX: the state as nested dicts (`nnx.state(model).to_pure_dict()`), a list of layers
  keyed by index (`layers/0/...`); a `value` level under each param is skipped;
- flax linen: `{"params": {"layers_0": ...}}`;
- stacked layers: one `layers` (or `decoder/layers`) subtree whose arrays hold every layer on a
  leading axis, as `nn.scan` and jax-llm-examples keep them (MaxText's scan axis 1 is not read).

Matrices are flax's `[in, out]` kernels (attention's may be split per head,
`[hidden, heads, head_dim]` and `[heads, head_dim, hidden]`), stored here `[out, in]`. A
parameter none of the names matches is refused, named, as is a missing or misshapen one
(`convert_tensors`).
"""

from __future__ import annotations

import os
import re

import numpy as np

from cbjax.config import ModelConfig
from cbjax.loading.model import Model, as_dtype, convert_tensors

PARAMS_DIR = "params"


def _in_out(w):  # a Dense kernel [in, out] (or [hidden, heads, head_dim]) as [out, in]
    return w.reshape(w.shape[0], -1).T


def _out_proj(w):  # an output kernel [in, out] (or [heads, head_dim, hidden]) as [out, in]
    return w.reshape(-1, w.shape[-1]).T


def _same(w):
    return w


_ATTN = r"(?:attn|self_attn|attention|self_attention)"
_LAYER = r"layers/(\d+)/"
_NAMES = [
    (r"(?:embed|embed_tokens|token_embedder|tok_embeddings|wte)/embedding", "embed", _same),
    (r"(?:final_norm|norm|decoder_norm|ln_f)/scale", "final_norm/scale", _same),
    (r"(?:lm_head|logits_dense|output)/kernel", "lm_head", _in_out),
    (_LAYER + r"(?:attn_norm|input_norm|input_layernorm|pre_attention_norm)/scale", "layers/attn_norm/scale", _same),
    (_LAYER + r"(?:mlp_norm|post_attention_layernorm|pre_ffw_norm|ffn_norm)/scale", "layers/mlp_norm/scale", _same),
    (_LAYER + _ATTN + r"/(?:q_proj|query|wq)/kernel", "layers/wq", _in_out),
    (_LAYER + _ATTN + r"/(?:k_proj|key|wk)/kernel", "layers/wk", _in_out),
    (_LAYER + _ATTN + r"/(?:v_proj|value|wv)/kernel", "layers/wv", _in_out),
    (_LAYER + _ATTN + r"/(?:o_proj|out|out_proj|wo)/kernel", "layers/wo", _out_proj),
    (_LAYER + _ATTN + r"/(?:q_proj|query|wq)/bias", "layers/bq", lambda b: b.reshape(-1)),
    (_LAYER + _ATTN + r"/(?:k_proj|key|wk)/bias", "layers/bk", lambda b: b.reshape(-1)),
    (_LAYER + _ATTN + r"/(?:v_proj|value|wv)/bias", "layers/bv", lambda b: b.reshape(-1)),
    (_LAYER + _ATTN + r"/(?:q_norm|query_norm)/scale", "layers/q_norm", _same),
    (_LAYER + _ATTN + r"/(?:k_norm|key_norm)/scale", "layers/k_norm", _same),
    (_LAYER + r"(?:mlp|feed_forward)/(?:gate_proj|wi_0|w1)/kernel", "layers/w_gate", _in_out),
    (_LAYER + r"(?:mlp|feed_forward)/(?:up_proj|wi_1|w3)/kernel", "layers/w_up", _in_out),
    (_LAYER + r"(?:mlp|feed_forward)/(?:down_proj|wo|w2)/kernel", "layers/w_down", _in_out),
]


def is_flax_checkpoint(path: str) -> bool:
    """A directory with orbax params beside a config.json, and no safetensors."""
    return (os.path.isdir(os.path.join(path, PARAMS_DIR)) and os.path.isfile(os.path.join(path, "config.json"))
            and not any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in os.listdir(path)))


def _flatten(tree, prefix: str = "") -> dict[str, np.ndarray]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}/"))
        return out
    return {prefix[:-1]: tree}


def named_params(tree: dict, num_layers: int) -> tuple[dict[str, np.ndarray], str]:
    """The checkpoint's arrays by one path spelling (`layers/3/attn/q_proj/kernel`), and the
    layout it was saved in."""
    flat = {re.sub(r"/(?:value|raw_value)$", "", name): value for name, value in _flatten(tree).items()}
    layout = "nnx"
    if all(name.startswith("params/") for name in flat):
        flat = {name[len("params/"):]: value for name, value in flat.items()}
        layout = "linen"
    flat = {re.sub(r"^(?:model|decoder|transformer)/", "", name): value for name, value in flat.items()}
    if any(re.match(r"layers_\d+/", name) for name in flat):
        flat = {re.sub(r"^layers_(\d+)/", r"layers/\1/", name): value for name, value in flat.items()}
    elif any(name.startswith("layers/") and not re.match(r"layers/\d+/", name) for name in flat):
        layout = "stacked"
        unstacked = {}
        for name, value in flat.items():
            if not name.startswith("layers/"):
                unstacked[name] = value
                continue
            if value.shape[:1] != (num_layers,):
                raise ValueError(f"stacked parameter {name!r} has shape {tuple(value.shape)}: its first axis "
                                 f"should hold the config's {num_layers} layers")
            for i in range(num_layers):
                unstacked[f"layers/{i}/{name[len('layers/'):]}"] = value[i]
        flat = unstacked
    return flat, layout


def load_flax_checkpoint(path: str, dtype=None, with_tokenizer: bool = True) -> Model:
    import orbax.checkpoint as ocp

    from cbjax.loading.huggingface import load_tokenizer

    path = os.path.abspath(path)
    config = ModelConfig.from_hf_dir(path)
    if config.is_gpt2 or config.is_moe:
        raise ValueError(f"{path}: a training checkpoint is read for Llama-family dense models, "
                         f"not model_type {config.model_type!r}")
    params_dir = os.path.join(path, PARAMS_DIR)
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(params_dir)
    named, layout = named_params(tree, config.num_layers)
    where = lambda name: f"{params_dir} ({layout} layout)"  # noqa: E731
    params = convert_tensors({name: (lambda v=value: np.asarray(v)) for name, value in named.items()}, config,
                             _NAMES, as_dtype("float32" if dtype is None else dtype), where)
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return Model(config, params, tokenizer, source=path)
