"""The bottom of the loaders: the `Model` type, dtypes, and the tensor conversion every
checkpoint format shares (checkpoint names onto our flat names, one entry per layer, shapes
checked)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.config import ModelConfig
from cbjax.loading import huge_pages
from cbjax.models.params import flatten_shapes, param_shapes, unflatten
from cbjax.models.quant import is_quantized


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


# Buffers some checkpoints carry that are not parameters.
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")



def _layer_name(ours: str, layer: int) -> str:
    """`layers/wq` of layer 3 -> `layers/3/wq` (the params layout, cbjax/models/params.py)."""
    return ours.replace("layers/", f"layers/{layer}/", 1)


def _split_c_attn(flat: dict, config: ModelConfig) -> None:
    d = config.hidden_size
    for i in range(config.num_layers):
        for fused, parts in (("c_attn_w", ("wq", "wk", "wv")), ("c_attn_b", ("bq", "bk", "bv"))):
            x = flat.pop(f"layers/{i}/{fused}", None)
            if x is not None:
                for j, part in enumerate(parts):
                    flat[f"layers/{i}/{part}"] = x[j * d:(j + 1) * d]


def _stack_experts(per_expert: dict, config: ModelConfig) -> dict:
    """`{(ours, layer): {expert: [..]}}` -> `{ours: {layer: [experts, ..]}}`, every expert present."""
    out: dict[str, dict[int, np.ndarray]] = {}
    for (ours, layer), experts in sorted(per_expert.items()):
        missing = [e for e in range(config.num_experts) if e not in experts]
        if missing:
            raise ValueError(f"checkpoint is missing expert(s) {missing} of {_layer_name(ours, layer)!r} (the config "
                             f"has {config.num_experts} experts; the checkpoint has {sorted(experts)})")
        if len(experts) != config.num_experts:
            raise ValueError(f"checkpoint has experts {sorted(set(experts) - set(range(config.num_experts)))} of "
                             f"{_layer_name(ours, layer)!r}, beyond the config's {config.num_experts}")
        shapes = {a.shape for a in experts.values()}
        if len(shapes) != 1:
            raise ValueError(f"checkpoint's experts of {_layer_name(ours, layer)!r} differ in shape: {shapes}")
        out.setdefault(ours, {})[layer] = np.stack([experts[e] for e in range(config.num_experts)])
    return out


def _split_gate_up(flat: dict, config: ModelConfig) -> None:
    """transformers v5's fused `[experts, 2 * width, hidden]` into the gate (first half) and up."""
    for i in range(config.num_layers):
        fused = flat.pop(f"layers/{i}/moe_w_gate_up", None)
        if fused is not None:
            half = fused.shape[1] // 2
            flat[f"layers/{i}/moe_w_gate"], flat[f"layers/{i}/moe_w_up"] = fused[:, :half], fused[:, half:]


def convert_tensors(
    named_tensors: dict[str, Callable[[], np.ndarray]],
    config: ModelConfig,
    names: list,
    dtype,
    where: Callable[[str], str],
) -> dict:
    """Map checkpoint tensors onto our flat names (`layers/3/wq`), check shapes.

    `named_tensors` maps a checkpoint name to a loader (so tensors are read one at a
    time); `where(name)` says which file holds a tensor, for error messages.
    """
    compiled = [(re.compile(p + r"$"), ours, fn) for p, ours, fn in names]
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    per_expert: dict[tuple, dict[int, np.ndarray]] = {}
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
        value = load()
        value = value if is_quantized(value) else fn(np.asarray(value))  # kept blocks as they are
        if m.groups():
            layer = int(m.group(1))
            if layer >= config.num_layers:
                raise ValueError(f"{where(name)}: tensor {name!r} is for layer {layer}, "
                                 f"but the config has {config.num_layers} layers")
            if len(m.groups()) == 2:  # one expert's matrix (cbjax/loading/huggingface.py, _MOE_NAMES)
                per_expert.setdefault((ours, layer), {})[int(m.group(2))] = value
            else:
                per_layer.setdefault(ours, {})[layer] = value
        else:
            flat[ours] = value

    expected = flatten_shapes(param_shapes(config))
    for ours, layers in _stack_experts(per_expert, config).items():
        per_layer.setdefault(ours, {}).update(layers)
    for ours, layers in per_layer.items():
        holders = [i for i in range(config.num_layers)
                   if _layer_name(ours, i) in expected or ours == "layers/moe_w_gate_up" and config.is_moe_layer(i)]
        missing = [i for i in holders if i not in layers]
        if missing:
            raise ValueError(f"checkpoint is missing {ours!r} for layers {missing}")
        shapes = {layers[i].shape for i in layers}
        if len(shapes) != 1:
            raise ValueError(f"checkpoint tensor {ours!r} has different shapes across layers: {shapes}")
        for i, value in layers.items():
            flat[_layer_name(ours, i)] = value
    if config.is_gpt2:
        _split_c_attn(flat, config)
    if config.is_moe:
        _split_gate_up(flat, config)

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

    # On the CPU the weights go into one mapping of 2 MB pages (huge_pages.py: a decode step
    # streams them all); elsewhere straight to the device.
    device = jax.devices()[0]
    arena = huge_pages.arena_for(sum(huge_pages.padded(v.nbytes if is_quantized(v) else v.size * dt.itemsize)
                                     for v in flat.values()), device)

    def put(v):
        if is_quantized(v):  # a GGUF file's blocks, onto the device as they are
            return dataclasses.replace(v, blocks=arena.place(v.blocks) if arena else jnp.asarray(v.blocks))
        v = v.astype(np.float32) if v.dtype not in (np.float32, dt) else v
        return arena.place(v, dt) if arena else jnp.asarray(v, dt)

    return unflatten({k: put(v) for k, v in flat.items()})
