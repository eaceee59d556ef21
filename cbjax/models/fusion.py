"""Projections that read the same input, fused into one matrix each: a layer's q, k and v into
`wqkv` ([q + 2 kv, hidden]), its MLP's gate and up into `w_gate_up` ([2 inter, hidden]), biases
alike. One matmul instead of three and one instead of two: on a GPU a decode step is launch-
bound for a small model (docs/engine.md), and one wider product also reads its input once.

Rows are concatenated along the output axis, so each part's outputs are a slice of the fused
product's (`split_qkv`, `split_gate_up`) and its values are exactly the unfused product's.
Works for float weights and for int8/fp8 ones (values and per-row scales concatenated alike);
a layer whose parts differ in kind (say one quantized, one not) stays unfused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FUSE_CHOICES = ("auto", "on", "off")
QKV, QKV_BIASES = ("wq", "wk", "wv"), ("bq", "bk", "bv")
GATE_UP, GATE_UP_BIASES = ("w_gate", "w_up"), ("b_gate", "b_up")


def _concat(parts: list):
    """Parts stacked along their output axis (axis 0 of every leaf), or None when their
    structures differ (a quantized weight beside a float one, different scale groups)."""
    structures = {jax.tree.structure(p) for p in parts}
    if len(structures) != 1:
        return None
    leaves = [jax.tree.leaves(p) for p in parts]
    if any(len({a.shape[1:] for a in column}) != 1 or len({a.dtype for a in column}) != 1
           for column in zip(*leaves)):
        return None
    return jax.tree.map(lambda *arrays: jnp.concatenate(arrays, axis=0), *parts)


def _fuse_group(p: dict, names: tuple, biases: tuple, fused: str, fused_bias: str) -> dict:
    if not all(n in p for n in names):
        return p
    has_bias = [b in p for b in biases]
    if any(has_bias) and not all(has_bias):
        return p
    weight = _concat([p[n] for n in names])
    bias = _concat([p[b] for b in biases]) if all(has_bias) else None
    if weight is None or (all(has_bias) and bias is None):
        return p
    out = {k: v for k, v in p.items() if k not in names and k not in biases}
    out[fused] = weight
    if bias is not None:
        out[fused_bias] = bias
    return out


def fuse_layer(p: dict) -> dict:
    """One layer's params with q/k/v and gate/up fused where their parts allow."""
    p = _fuse_group(p, QKV, QKV_BIASES, "wqkv", "bqkv")
    return _fuse_group(p, GATE_UP, GATE_UP_BIASES, "w_gate_up", "b_gate_up")


def fuse_projections(params: dict, release: bool = False) -> dict:
    """`params` with every layer fused (`fuse_layer`); the rest as it was. `release`: the caller
    owns `params` and drops them after, so each layer's parts are freed once fused (the fused
    copy then never holds much more than one layer's matrices twice on the device)."""
    layers = []
    for p in params["layers"]:
        fused = fuse_layer(p)
        if release:
            for name in set(p) - set(fused):
                for a in jax.tree.leaves(p[name]):
                    if isinstance(a, jax.Array) and not a.is_deleted():
                        a.delete()
        layers.append(fused)
    return {**params, "layers": layers}


def is_fused(params: dict) -> bool:
    return any("wqkv" in p or "w_gate_up" in p for p in params.get("layers", []))


def split_qkv(qkv: jax.Array, config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused product's last axis as q, k and v outputs."""
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return qkv[..., :q_dim], qkv[..., q_dim:q_dim + kv_dim], qkv[..., q_dim + kv_dim:]


def split_gate_up(gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]
