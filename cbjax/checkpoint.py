"""Checkpoints into the params pytree: Hugging Face directories, GGUF files, orbax.

`load_model(spec)` is the one entry point: `spec` is a preset name (see
`presets.py`), a Hugging Face directory, a `.gguf` file, or a directory written
by `save_orbax`. Every failure names the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.config import ModelConfig
from cbjax.models.params import check_params, flatten_shapes, param_shapes, unflatten

ORBAX_CONFIG_FILE = "cbjax_config.json"
ORBAX_PARAMS_DIR = "params"


@dataclasses.dataclass
class Model:
    """A loaded model: config, params pytree and (when the checkpoint has one) a tokenizer."""

    config: ModelConfig
    params: dict
    tokenizer: Any = None
    source: str = ""


def as_dtype(dtype) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"unknown dtype {dtype!r}") from e
    if dt not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return dt


# ---------------------------------------------------------------- name mapping

# (HF tensor name pattern, our flat name, transform). `L` in our name means the
# tensor is per layer and `{i}` in the pattern captures the layer index.
_T = lambda w: w.T  # noqa: E731  HF Linear stores [out, in]; we store [in, out].
_ID = lambda w: w  # noqa: E731

_LLAMA_NAMES = [
    (r"model\.embed_tokens\.weight", "embed", _ID),
    (r"model\.norm\.weight", "final_norm/scale", _ID),
    (r"lm_head\.weight", "lm_head", _T),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers/attn_norm/scale", _ID),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers/mlp_norm/scale", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers/wq", _T),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers/wk", _T),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers/wv", _T),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers/wo", _T),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "layers/bq", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "layers/bk", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "layers/bv", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.bias", "layers/bo", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers/q_norm", _ID),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers/k_norm", _ID),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers/w_gate", _T),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers/w_up", _T),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers/w_down", _T),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.bias", "layers/b_gate", _ID),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.bias", "layers/b_up", _ID),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.bias", "layers/b_down", _ID),
]

# GPT-2 uses Conv1D ([in, out]) and a fused c_attn that is split afterwards.
_GPT2_NAMES = [
    (r"(?:transformer\.)?wte\.weight", "embed", _ID),
    (r"(?:transformer\.)?wpe\.weight", "pos_embed", _ID),
    (r"(?:transformer\.)?ln_f\.weight", "final_norm/scale", _ID),
    (r"(?:transformer\.)?ln_f\.bias", "final_norm/bias", _ID),
    (r"lm_head\.weight", "lm_head", _T),
    (r"(?:transformer\.)?h\.(\d+)\.ln_1\.weight", "layers/attn_norm/scale", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.ln_1\.bias", "layers/attn_norm/bias", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.ln_2\.weight", "layers/mlp_norm/scale", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.ln_2\.bias", "layers/mlp_norm/bias", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.weight", "layers/c_attn_w", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.bias", "layers/c_attn_b", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_proj\.weight", "layers/wo", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_proj\.bias", "layers/bo", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_fc\.weight", "layers/w_up", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_fc\.bias", "layers/b_up", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_proj\.weight", "layers/w_down", _ID),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_proj\.bias", "layers/b_down", _ID),
]

# Buffers some checkpoints carry that are not parameters.
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


def _split_c_attn(flat: dict, config: ModelConfig) -> None:
    d = config.hidden_size
    w = flat.pop("layers/c_attn_w", None)
    b = flat.pop("layers/c_attn_b", None)
    if w is not None:
        flat["layers/wq"], flat["layers/wk"], flat["layers/wv"] = (w[..., i * d:(i + 1) * d] for i in range(3))
    if b is not None:
        flat["layers/bq"], flat["layers/bk"], flat["layers/bv"] = (b[..., i * d:(i + 1) * d] for i in range(3))


def convert_tensors(
    named_tensors: dict[str, Callable[[], np.ndarray]],
    config: ModelConfig,
    names: list,
    dtype,
    where: Callable[[str], str],
) -> dict:
    """Map checkpoint tensors onto our flat names, stack layers, check shapes.

    `named_tensors` maps a checkpoint name to a loader (so tensors are read one at a
    time); `where(name)` says which file holds a tensor, for error messages.
    """
    compiled = [(re.compile(p + r"$"), ours, fn) for p, ours, fn in names]
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    flat: dict[str, np.ndarray] = {}
    for name, load in named_tensors.items():
        for pattern, ours, fn in compiled:
            m = pattern.match(name)
            if m:
                break
        else:
            if _IGNORED.match(name):
                continue
            raise ValueError(f"{where(name)}: unexpected tensor {name!r} for model_type {config.model_type!r}")
        if ours == "lm_head" and config.tie_embeddings:
            continue
        value = fn(np.asarray(load()))
        if m.groups():
            layer = int(m.group(1))
            if layer >= config.num_layers:
                raise ValueError(f"{where(name)}: tensor {name!r} is for layer {layer}, "
                                 f"but the config has {config.num_layers} layers")
            per_layer.setdefault(ours, {})[layer] = value
        else:
            flat[ours] = value

    expected = flatten_shapes(param_shapes(config))
    for ours, layers in per_layer.items():
        missing = [i for i in range(config.num_layers) if i not in layers]
        if missing:
            raise ValueError(f"checkpoint is missing {ours!r} for layers {missing}")
        shapes = {layers[i].shape for i in layers}
        if len(shapes) != 1:
            raise ValueError(f"checkpoint tensor {ours!r} has different shapes across layers: {shapes}")
        flat[ours] = np.stack([layers[i] for i in range(config.num_layers)])
    if config.is_gpt2:
        _split_c_attn(flat, config)

    for ours, shape in expected.items():
        if ours not in flat:
            raise ValueError(f"checkpoint has no tensor for {ours!r} (expected shape {shape})")
        if flat[ours].shape != shape:
            raise ValueError(f"checkpoint tensor for {ours!r} has shape {flat[ours].shape}, "
                             f"config expects {shape}")
    extra = sorted(set(flat) - set(expected))
    if extra:
        raise ValueError(f"checkpoint has tensors {extra} that model_type {config.model_type!r} does not use")
    dt = as_dtype(dtype)
    return unflatten({k: jnp.asarray(v.astype(np.float32) if v.dtype != np.float32 else v, dt)
                      for k, v in flat.items()})


# ------------------------------------------------------------ Hugging Face dirs

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

    names = _GPT2_NAMES if config.is_gpt2 else _LLAMA_NAMES
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


# ----------------------------------------------------------------------- orbax

def save_orbax(model: Model, path: str) -> None:
    """Save converted params (and the config) so a large conversion is done once."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, ORBAX_PARAMS_DIR), model.params, force=True)
    with open(os.path.join(path, ORBAX_CONFIG_FILE), "w") as f:
        json.dump({"config": model.config.to_dict(), "source": model.source}, f, indent=1)


def is_orbax_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ORBAX_CONFIG_FILE))


def load_orbax(path: str, dtype=None) -> Model:
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    config_path = os.path.join(path, ORBAX_CONFIG_FILE)
    with open(config_path) as f:
        meta = json.load(f)
    config = ModelConfig.from_dict(meta["config"])
    params_dir = os.path.join(path, ORBAX_PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"{path!r} has {ORBAX_CONFIG_FILE} but no {ORBAX_PARAMS_DIR}/ directory")
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(params_dir)
        tree = getattr(stored, "item_metadata", stored)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)
        params = ckptr.restore(params_dir, target)
    check_params(params, config, source=params_dir)
    if dtype is not None:
        dt = as_dtype(dtype)
        params = jax.tree.map(lambda x: x.astype(dt), params)
    source = meta.get("source", "")
    tokenizer = None
    if source and os.path.exists(source):
        tokenizer = _tokenizer_for(source)
    return Model(config, params, tokenizer, source=path)


def _tokenizer_for(source: str):
    if source.endswith(".gguf"):
        from cbjax.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(source)
    return load_tokenizer(source)


# ------------------------------------------------------------------ dispatcher

def load_model(spec: str, dtype=None, seed: int = 0, with_tokenizer: bool = True) -> Model:
    """A preset name, a Hugging Face directory, a GGUF file or an orbax directory.

    `dtype` None keeps an orbax checkpoint's stored dtype and means float32 otherwise."""
    from cbjax import presets

    if spec is not None and os.path.isdir(spec) and is_orbax_dir(spec):
        return load_orbax(spec, dtype=dtype)
    dtype = as_dtype("float32" if dtype is None else dtype)
    if spec in presets.PRESETS:
        return presets.load_preset(spec, dtype=dtype, seed=seed, with_tokenizer=with_tokenizer)
    if os.path.isfile(spec) and spec.endswith(".gguf"):
        from cbjax.gguf_loader import load_gguf
        return load_gguf(spec, dtype=dtype, with_tokenizer=with_tokenizer)
    if os.path.isdir(spec):
        return load_hf_dir(spec, dtype=dtype, with_tokenizer=with_tokenizer)
    raise ValueError(
        f"cannot load model {spec!r}: not a preset ({', '.join(sorted(presets.PRESETS))}), "
        "a Hugging Face directory, a .gguf file or an orbax directory")
