"""Small pure building blocks: norms, rotary embeddings, MLPs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.config import ModelConfig
from cbjax.models.fusion import split_gate_up
from cbjax.models.ops import XLA, Ops


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    # Statistics in float32, then back to the activation dtype before the scale, as
    # transformers' LlamaRMSNorm does (this matters for bfloat16 parity).
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def norm(x: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    if "bias" in p:
        return layer_norm(x, p["scale"], p["bias"], config.norm_eps)
    return rms_norm(x, p["scale"], config.norm_eps)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies `[head_dim // 2]` with the config's RoPE scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    scaling = config.rope_scaling_dict
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin, `[B, T, head_dim // 2]`, for integer positions `[B, T]`."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout) on `[B, T, heads, head_dim]`."""
    half = x.shape[-1] // 2
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None, ops: Ops = XLA) -> jax.Array:
    """`x @ w.T + b` for a weight stored `[out, in]` (see cbjax/models/params.py), by `ops`."""
    y = ops.dense(x, w)
    return y if b is None else y + b


def mlp(x: jax.Array, p: dict, config: ModelConfig, ops: Ops = XLA, lora=None, layer: int = 0) -> jax.Array:
    """The dense MLP; `lora`: each token's adapter added to gate/up/down (cbjax/models/lora.py)."""
    def adapted(y, inputs, module):
        return y if lora is None else lora.add(y, inputs, module, layer)

    if "w_gate_up" in p:  # one product for the two (cbjax/models/fusion.py)
        gate, up = split_gate_up(dense(x, p["w_gate_up"], p.get("b_gate_up"), ops))
        h = jax.nn.silu(adapted(gate, x, "gate_proj")) * adapted(up, x, "up_proj")
    elif config.is_gpt2:
        h = jax.nn.gelu(dense(x, p["w_up"], p.get("b_up"), ops), approximate=True)
    else:
        h = (jax.nn.silu(adapted(dense(x, p["w_gate"], p.get("b_gate"), ops), x, "gate_proj"))
             * adapted(dense(x, p["w_up"], p.get("b_up"), ops), x, "up_proj"))
    return adapted(dense(h, p["w_down"], p.get("b_down"), ops), h, "down_proj")
