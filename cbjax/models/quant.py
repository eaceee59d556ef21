"""Weight-only quantization: a matrix kept as 8-bit values and a float32 scale per group of a row.

`QuantizedWeight` stands where a `[out, in]` matrix of the params pytree stood
(cbjax/models/params.py): each row is split into groups of `GROUP_SIZES[0]` inputs (or the
first of `GROUP_SIZES` that divides `in`; one group per row if none does), and group g of
row i is `values[i, g] * scale[i, g]`, symmetric, scaled so that the group's largest
magnitude maps to the format's largest value (127 for int8, 448 for fp8 e4m3). Groups, as
llama.cpp's Q8_0 blocks and AWQ/GPTQ's groups: one scale per output row cost SmolLM2-135M
1.2% perplexity in int8 (the MLP 0.8%, attention 0.34%), past the 1% that 8 bits should keep.
Norms, biases and the input embedding stay in the model's dtype; a tied embedding is
the LM head too, so it is quantized and its gathered rows are dequantized
(`embedding_rows`).

Decode streams every weight once per step, so a step's time is its bytes: int8 and fp8
weights halve bf16's. The matmul reads the 8-bit operand, widens and scales it inside the
dot (`dense`), which XLA fuses on a GPU; with one group per row the scale multiplies the f32
accumulator once per output instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.models import gguf_blocks
from cbjax.models.gguf_blocks import GGUFWeight

QUANTIZATIONS = ("none", "int8", "fp8", "gguf")
# The matrices quantized: every matmul of a layer and the LM head (cbjax/models/params.py).
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "wqkv", "w_gate_up")  # and fused (fusion.py)
_FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
GROUP_SIZES = (128, 64, 32)  # inputs per scale: the first that divides a matrix's `in`


class ScaledValues:
    """What 8-bit `values` with their float32 `scale` look like from outside, as an array would:
    the values' shape and dtype, and the bytes of both (QuantizedWeight, kv_cache.QuantizedKV)."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight(ScaledValues):
    values: jax.Array  # [out, in] int8 or float8_e4m3fn
    scale: jax.Array  # [out, groups] float32

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return _scaled(self.values, self.scale).astype(dtype)


def _scaled(values: jax.Array, scale: jax.Array) -> jax.Array:
    """`values [..., in]` times their groups' `scale [..., groups]`, in f32."""
    groups = scale.shape[-1]
    v = values.astype(jnp.float32).reshape(values.shape[:-1] + (groups, -1))
    return (v * scale[..., None]).reshape(values.shape)


def group_size(in_dim: int) -> int:
    return next((g for g in GROUP_SIZES if in_dim % g == 0 and in_dim > g), in_dim)


def quantize(w: jax.Array, mode: str) -> QuantizedWeight:
    """`w [out, in]` as `mode` values with a scale per group of `group_size(in)` inputs of a
    row (an all-zero group gets scale 1)."""
    dtype, top = _FORMATS[mode]
    out_dim, in_dim = w.shape
    wf = jnp.asarray(w, jnp.float32).reshape(out_dim, -1, group_size(in_dim))
    peak = jnp.max(jnp.abs(wf), axis=-1)
    scale = jnp.where(peak > 0, peak / top, 1.0)
    scaled = (wf / scale[..., None]).reshape(out_dim, in_dim)
    values = jnp.clip(jnp.round(scaled), -top, top).astype(dtype) if mode == "int8" else scaled.astype(dtype)
    return QuantizedWeight(values, scale.astype(jnp.float32))


_quantize_jit = jax.jit(quantize, static_argnums=1)


def quantize_params(params: dict, mode: str, tied_embeddings: bool) -> dict:
    """The params pytree with its matrices (and a tied embedding, the LM head) quantized to
    `mode`; "none" returns it as it is. Each tensor is quantized where it lives, one at a time."""
    if mode == "none":
        return params
    if mode == "gguf":
        raise ValueError("quantization='gguf' keeps a GGUF file's blocks: load a .gguf file with it")
    if mode not in _FORMATS:
        raise ValueError(f"quantization={mode!r}: expected one of {', '.join(QUANTIZATIONS)}")

    def matrices(tree: dict, names) -> dict:
        return {k: _quantize_jit(v, mode) if k in names and not isinstance(v, QuantizedWeight) else v
                for k, v in tree.items()}

    out = matrices({k: v for k, v in params.items() if k != "layers"},
                   MATRICES + (("embed",) if tied_embeddings else ()))
    out["layers"] = [matrices(layer, MATRICES) for layer in params["layers"]]
    return out


def quantization_of(params: dict) -> str:
    """"int8", "fp8" or "none": what `quantize_params` made of these params."""
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        if isinstance(leaf, GGUFWeight):
            return "gguf"
        if isinstance(leaf, QuantizedWeight):
            return "int8" if leaf.values.dtype == jnp.int8 else "fp8"
    return "none"


def is_quantized(x) -> bool:
    return isinstance(x, (QuantizedWeight, GGUFWeight))


def rebuild(tree):
    """A restored params tree (orbax gives `{"values", "scale"}` dicts back) with its quantized
    matrices as `QuantizedWeight`s again."""
    if isinstance(tree, dict):
        if set(tree) == {"values", "scale"}:
            return QuantizedWeight(tree["values"], tree["scale"])
        return {k: rebuild(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [rebuild(v) for v in tree]
    return tree


def cast(params: dict, dtype) -> dict:
    """Every unquantized tensor in `dtype` (quantized matrices keep their values and scales)."""
    return jax.tree.map(lambda x: x if is_quantized(x) else x.astype(dtype), params, is_leaf=is_quantized)


def activation_dtype(params: dict):
    """The model's own dtype (its activations', its KV cache's by default): its first tensor
    that is not quantized (a norm's scale at least; a pipeline stage's too)."""
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        if not is_quantized(leaf):
            return leaf.dtype
    raise ValueError("params hold no unquantized tensor to take the model's dtype from")


def weight_bytes(params) -> int:
    """Bytes the params hold (values and scales of quantized matrices)."""
    return int(sum(np.dtype(x.dtype).itemsize * x.size for x in jax.tree.leaves(params)))


def embedding_rows(embed, tokens: jax.Array, dtype) -> jax.Array:
    """`embed[tokens]` in `dtype`, dequantizing only the gathered rows of a quantized table."""
    if isinstance(embed, QuantizedWeight):
        return _scaled(embed.values[tokens], embed.scale[tokens]).astype(dtype)
    if isinstance(embed, GGUFWeight):
        return gguf_blocks.embedding_rows(embed, tokens, dtype)
    return embed[tokens]


def dense(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """`x @ w.T` for a quantized `w`, in x's dtype. The 8-bit values are widened (exact: every
    int8 and e4m3 value is a bf16) and scaled by their groups inside the product; a single
    group per row scales the f32 result per output instead."""
    operand = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    per_row = w.scale.shape[-1] == 1
    weight = w.values.astype(operand) if per_row else _scaled(w.values, w.scale).astype(operand)
    y = jnp.einsum("...d,od->...o", x.astype(operand), weight, preferred_element_type=jnp.float32)
    return (y * w.scale[:, 0] if per_row else y).astype(x.dtype)


def fp8_refusal(device) -> str | None:
    """Why `device` cannot run fp8 weights (naming the knob), or None: fp8 needs fp8 dots, an
    NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell)."""
    if device.platform in ("gpu", "cuda"):
        capability = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(p) for p in str(capability).split(".")[:2])
        except ValueError:
            return f"quantization='fp8': cannot read the compute capability of {device.device_kind}"
        if (major, minor) >= (8, 9):
            return None
        return (f"quantization='fp8' needs fp8 dots (compute capability 8.9+), {device.device_kind} has "
                f"{capability}: use quantization='int8'")
    return (f"quantization='fp8' needs a backend with fp8 dots (an NVIDIA GPU of compute capability 8.9+); "
            f"this is {device.platform} ({device.device_kind}): use quantization='int8'")
