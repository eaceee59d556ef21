"""The params pytree: one shape spec, and a seeded random init for presets and tests.

Layout (matrices stored `[out, in]`, as torch.nn.Linear stores them; `layers` is a
list with one dict per layer):

    embed        [vocab, hidden]
    pos_embed    [max_pos, hidden]                  (gpt2)
    layers/i/attn_norm/{scale, bias?}, layers/i/mlp_norm/{scale, bias?}
    layers/i/wq [heads*hd, hidden], wk/wv [kv_heads*hd, hidden], wo [hidden, heads*hd]
    layers/i/bq, bk, bv, bo                         (when the family has them)
    layers/i/q_norm, k_norm [hd]                    (qwen3)
    layers/i/w_gate?, w_up [inter, hidden], w_down [hidden, inter], b_* (mlp bias)
  a mixture-of-experts layer instead of the MLP (cbjax/models/moe.py; E experts of width I):
    layers/i/router [E, hidden]
    layers/i/moe_w_gate, moe_w_up [E, I, hidden], moe_w_down [E, hidden, I]
    layers/i/shared_w_gate, shared_w_up [S, hidden], shared_w_down [hidden, S],
             shared_expert_gate [1, hidden]   (Qwen2-MoE's shared expert)
    final_norm/{scale, bias?}
    lm_head      [vocab, hidden]                    (untied only)

`[out, in]` because every matmul then contracts the contiguous axis of both operands
(a dot product per output row), which XLA:CPU runs faster than `[in, out]` at every batch
past one (docs/code_measurements.md).

Each layer's tensors are their own arrays, not slices of one stacked `[layers, ...]`
array: XLA:CPU copies a slice of a stacked weight out before every matmul (a dot
cannot read a dynamic or static slice in place), which multiplied the decode step's
weight traffic (docs/code_measurements.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.config import ModelConfig
from cbjax.models.quant import is_quantized


def param_shapes(config: ModelConfig) -> dict:
    """Nested dict of shapes, the single source of truth for loaders and init."""
    c = config
    d, hd = c.hidden_size, c.head_dim
    q_dim, kv_dim, inter = c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size

    def norm_shape():
        s = {"scale": (d,)}
        if c.is_gpt2:
            s["bias"] = (d,)
        return s

    attention = {
        "attn_norm": norm_shape(),
        "mlp_norm": norm_shape(),
        "wq": (q_dim, d),
        "wk": (kv_dim, d),
        "wv": (kv_dim, d),
        "wo": (d, q_dim),
    }
    if c.qkv_bias:
        attention.update(bq=(q_dim,), bk=(kv_dim,), bv=(kv_dim,))
    if c.o_bias:
        attention["bo"] = (d,)
    if c.qk_norm:
        attention.update(q_norm=(q_dim,), k_norm=(kv_dim,)) if c.qk_norm_whole else attention.update(
            q_norm=(hd,), k_norm=(hd,))
    dense = {"w_up": (inter, d), "w_down": (d, inter)}
    if not c.is_gpt2:
        dense["w_gate"] = (inter, d)
    if c.mlp_bias:
        dense.update(b_up=(inter,), b_down=(d,))
        if not c.is_gpt2:
            dense["b_gate"] = (inter,)
    experts, width, shared = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    moe = {"router": (experts, d), "moe_w_gate": (experts, width, d), "moe_w_up": (experts, width, d),
           "moe_w_down": (experts, d, width)}
    if shared:
        moe.update(shared_w_gate=(shared, d), shared_w_up=(shared, d), shared_w_down=(d, shared),
                   shared_expert_gate=(1, d))
    layers = [{**attention, **(moe if c.is_moe_layer(i) else dense)} for i in range(c.num_layers)]
    shapes = {"embed": (c.vocab_size, d), "layers": layers, "final_norm": norm_shape()}
    if c.position_embedding == "learned":
        shapes["pos_embed"] = (c.max_position_embeddings, d)
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.vocab_size, d)
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def flatten_shapes(shapes: dict | list, prefix: str = "") -> dict[str, tuple]:
    """`{"a/b": shape}`; list items are named by their index (`layers/3/wq`)."""
    out = {}
    for k, v in (enumerate(shapes) if isinstance(shapes, list) else shapes.items()):
        name = f"{prefix}{k}"
        if _is_shape(v):
            out[name] = v
        else:
            out.update(flatten_shapes(v, name + "/"))
    return out


def unflatten(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return _lists(tree)


def _lists(node):
    """Dicts keyed 0..n-1 (from flattened list items) back into lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node) and sorted(map(int, node)) == list(range(len(node))):
        return [node[str(i)] for i in range(len(node))]
    return node


def check_params(params: dict, config: ModelConfig, source: str = "params") -> None:
    """Raise a ValueError naming the tensor when params don't match the config's shapes."""
    expected = flatten_shapes(param_shapes(config))
    got = {  # a quantized matrix (cbjax/models/quant.py) counts as one tensor of its shape
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_quantized)
    }
    for name, shape in expected.items():
        if name not in got:
            raise ValueError(f"{source}: missing tensor {name!r} (expected shape {shape})")
        if got[name] != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {got[name]}, config expects {shape}")
    extra = sorted(set(got) - set(expected))
    if extra:
        raise ValueError(f"{source}: unexpected tensors {extra} for model_type {config.model_type!r}")


def init_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Seeded random params: normal(0, std) matrices, unit norms, small random biases.
    Each per-layer tensor is drawn for all the layers that have it at once and then split, so
    a seed gives the same model as when the layers were stored stacked."""
    flat = flatten_shapes(param_shapes(config))
    stacked, holders = {}, {}
    for name, shape in flat.items():
        parts = name.split("/")
        if parts[0] == "layers":
            key = "/".join(["layers"] + parts[2:])
            holders.setdefault(key, []).append(int(parts[1]))
            stacked[key] = (len(holders[key]), *shape)
        else:
            stacked[name] = shape
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(stacked):
        shape = stacked[name]
        leaf = name.rsplit("/", 1)[-1]
        if leaf == "scale" or leaf in ("q_norm", "k_norm"):
            value = np.ones(shape, np.float32)
        else:
            value = rng.normal(0.0, std, shape).astype(np.float32)
        if name.startswith("layers/"):
            for j, i in enumerate(holders[name]):
                out[name.replace("layers/", f"layers/{i}/", 1)] = jnp.asarray(value[j], dtype)
        else:
            out[name] = jnp.asarray(value, dtype)
    return unflatten(out)


def init_params_on_device(config: ModelConfig, seed: int = 0, dtype=jnp.bfloat16, std: float = 0.02) -> dict:
    """Random params drawn on the default device in `dtype` (normal(0, std) matrices, unit
    norms, zero biases): an 8B model's 16 GB in seconds, without the host copy `init_params`
    makes. For benchmarks of shapes with no checkpoint; not the same values as `init_params`."""
    key = jax.random.key(seed)
    flat = flatten_shapes(param_shapes(config))
    normal = jax.jit(lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype),
                     static_argnums=1)
    out = {}
    for i, (name, shape) in enumerate(sorted(flat.items())):
        leaf = name.rsplit("/", 1)[-1]
        if leaf == "scale" or leaf in ("q_norm", "k_norm"):
            out[name] = jnp.ones(shape, dtype)
        elif leaf == "bias" or leaf.startswith("b"):
            out[name] = jnp.zeros(shape, dtype)
        else:
            out[name] = normal(jax.random.fold_in(key, i), shape)
    return unflatten(out)
