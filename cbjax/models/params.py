"""The params pytree: one shape spec, and a seeded random init for presets and tests.

Layout (per-layer tensors stacked on a leading `layers` axis so the forward can
`lax.scan` over them; matrices stored `[in, out]`):

    embed        [vocab, hidden]
    pos_embed    [max_pos, hidden]                  (gpt2)
    layers/attn_norm/{scale, bias?}, layers/mlp_norm/{scale, bias?}
    layers/wq [L, hidden, heads*hd], wk/wv [L, hidden, kv_heads*hd], wo [L, heads*hd, hidden]
    layers/bq, bk, bv, bo                           (when the family has them)
    layers/q_norm, k_norm [L, hd]                   (qwen3)
    layers/w_gate?, w_up [L, hidden, inter], w_down [L, inter, hidden], b_* (mlp bias)
    final_norm/{scale, bias?}
    lm_head      [hidden, vocab]                    (untied only)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.config import ModelConfig


def param_shapes(config: ModelConfig) -> dict:
    """Nested dict of shapes, the single source of truth for loaders and init."""
    c = config
    L, d, hd = c.num_layers, c.hidden_size, c.head_dim
    q_dim, kv_dim, inter = c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size

    def norm_shape(*lead):
        s = {"scale": (*lead, d)}
        if c.is_gpt2:
            s["bias"] = (*lead, d)
        return s

    layers = {
        "attn_norm": norm_shape(L),
        "mlp_norm": norm_shape(L),
        "wq": (L, d, q_dim),
        "wk": (L, d, kv_dim),
        "wv": (L, d, kv_dim),
        "wo": (L, q_dim, d),
        "w_up": (L, d, inter),
        "w_down": (L, inter, d),
    }
    if not c.is_gpt2:
        layers["w_gate"] = (L, d, inter)
    if c.qkv_bias:
        layers.update(bq=(L, q_dim), bk=(L, kv_dim), bv=(L, kv_dim))
    if c.o_bias:
        layers["bo"] = (L, d)
    if c.mlp_bias:
        layers.update(b_up=(L, inter), b_down=(L, d))
        if not c.is_gpt2:
            layers["b_gate"] = (L, inter)
    if c.qk_norm:
        layers.update(q_norm=(L, hd), k_norm=(L, hd))

    shapes = {"embed": (c.vocab_size, d), "layers": layers, "final_norm": norm_shape()}
    if c.position_embedding == "learned":
        shapes["pos_embed"] = (c.max_position_embeddings, d)
    if not c.tie_embeddings:
        shapes["lm_head"] = (d, c.vocab_size)
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def flatten_shapes(shapes: dict, prefix: str = "") -> dict[str, tuple]:
    out = {}
    for k, v in shapes.items():
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
    return tree


def check_params(params: dict, config: ModelConfig, source: str = "params") -> None:
    """Raise a ValueError naming the tensor when params don't match the config's shapes."""
    expected = flatten_shapes(param_shapes(config))
    got = {
        "/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
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
    """Seeded random params: normal(0, std) matrices, unit norms, small random biases."""
    flat = flatten_shapes(param_shapes(config))
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(flat):
        shape = flat[name]
        leaf = name.rsplit("/", 1)[-1]
        if leaf == "scale" or leaf in ("q_norm", "k_norm"):
            value = np.ones(shape, np.float32)
        else:
            value = rng.normal(0.0, std, shape).astype(np.float32)
        out[name] = jnp.asarray(value, dtype)
    return unflatten(out)
