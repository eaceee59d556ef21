"""The mixture-of-experts layer: a router picks `top_k` of `E` experts for each token, each expert
is a gated-SiLU MLP, and a token's output is its experts' outputs weighted by the router.

Inside the one ragged step every token of the call (prefill chunks and decodes alike) is
routed at once; routing is data, never part of a program's key. The experts are computed one
by the backend's own kernel where it has one (`Ops.expert_dense`: on a CPU the C++ kernel reads
each chosen expert in place, once for all the pairs that chose it), else one of two ways,
chosen by the call's static size:

- `gathered`: few (token, expert) pairs (at most `E`, a decode step of a small batch): each
  pair's expert matrices are gathered and applied to its token, so the step reads only the
  experts its tokens route to. XLA:CPU's `ragged_dot` computes every expert for every row.
- `grouped`: the pairs sorted by expert and one grouped matmul (`jax.lax.ragged_dot_general`)
  over the groups, each expert's weights read once, then scattered back by token.

No token is dropped unless `config.expert_capacity_factor` is set: then an expert takes at most
`ceil(factor * tokens * top_k / E)` of the call's valid tokens, first come first served in the
call's token order, and a dropped pair contributes nothing (its token keeps its other experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cbjax.config import ModelConfig
from cbjax.models.ops import XLA, Ops

# A pair is one (token, chosen expert); the expert's matrices are [E, width, hidden] (gate, up)
# and [E, hidden, width] (down), stored [out, in] like every matrix (cbjax/models/params.py).
_ROWS_BY_EXPERT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def route(h: jax.Array, router: jax.Array, config: ModelConfig, ops: Ops = XLA) -> tuple[jax.Array, jax.Array]:
    """`(weights [N, k] f32, experts [N, k] int32)` for tokens `h [N, hidden]`: the softmax over
    every expert's logit, its top k, renormalized to sum to one where the config says so."""
    logits = ops.dense(h, router).astype(jnp.float32)
    top, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), config.num_experts_per_tok)
    if config.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts.astype(jnp.int32)


def place_in_group(groups: jax.Array, num_groups: int, counted: jax.Array | None = None) -> jax.Array:
    """For items `[P]` in `groups` (ints below `num_groups`): each item's place among the earlier
    items of its group (0 for the first), counting only the `counted` ones (0 for the others)."""
    hits = jax.nn.one_hot(groups, num_groups, dtype=jnp.int32)
    if counted is not None:
        hits = hits * counted[:, None]
    return jnp.sum((jnp.cumsum(hits, axis=0) - 1) * hits, axis=-1)


def kept_pairs(experts: jax.Array, valid: jax.Array, config: ModelConfig) -> jax.Array:
    """`[N, k]` bool: the pairs their expert computes. Padding tokens route nowhere; under a
    capacity factor an expert keeps its first `capacity` valid tokens in the call's order."""
    keep = jnp.broadcast_to(valid[:, None], experts.shape)
    factor = config.expert_capacity_factor
    if factor is None:
        return keep
    num_experts = config.num_experts
    rank = place_in_group(experts.reshape(-1), num_experts, keep.reshape(-1)).reshape(experts.shape)
    tokens = jnp.sum(valid.astype(jnp.int32))
    capacity = jnp.ceil(factor * tokens * config.num_experts_per_tok / num_experts).astype(jnp.int32)
    return keep & (rank < capacity)


def tokens_per_expert(experts: jax.Array, keep: jax.Array, num_experts: int) -> jax.Array:
    """`[E]` int32: how many of the call's kept pairs each expert computes."""
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(keep.reshape(-1).astype(jnp.int32))


def _gathered(h, experts, weights, p):
    """Each pair's own expert matrices, gathered: reads only the routed experts."""
    k = experts.shape[1]
    ids = experts.reshape(-1)
    x = jnp.repeat(h, k, axis=0)
    gate = jnp.einsum("ph,pih->pi", x, p["moe_w_gate"][ids])
    up = jnp.einsum("ph,pih->pi", x, p["moe_w_up"][ids])
    y = jnp.einsum("pi,phi->ph", jax.nn.silu(gate) * up, p["moe_w_down"][ids])
    y = y * weights.reshape(-1, 1).astype(y.dtype)
    return jnp.sum(y.reshape(h.shape[0], k, -1), axis=1)


def _grouped(h, experts, weights, p):
    """The pairs sorted by expert, one grouped matmul per matrix, scattered back by token."""
    k, num_experts = experts.shape[1], p["moe_w_gate"].shape[0]
    ids = experts.reshape(-1)
    order = jnp.argsort(ids, stable=True)
    token = order // k
    sizes = jnp.zeros((num_experts,), jnp.int32).at[ids].add(1)
    x = h[token]

    def grouped(a, w):
        return jax.lax.ragged_dot_general(a, w, sizes, _ROWS_BY_EXPERT, preferred_element_type=a.dtype)

    act = jax.nn.silu(grouped(x, p["moe_w_gate"])) * grouped(x, p["moe_w_up"])
    y = grouped(act, p["moe_w_down"]) * weights.reshape(-1)[order][:, None].astype(h.dtype)
    return jnp.zeros_like(h).at[token].add(y)


def _by_ops(h, experts, weights, p, ops):
    """The pairs' products by the backend's expert kernel (`Ops.expert_dense`), or None."""
    k = experts.shape[1]
    ids = experts.reshape(-1)
    x = jnp.repeat(h, k, axis=0)
    gate = ops.expert_dense(x, p["moe_w_gate"], ids)
    if gate is None:
        return None
    act = jax.nn.silu(gate) * ops.expert_dense(x, p["moe_w_up"], ids)
    y = ops.expert_dense(act, p["moe_w_down"], ids) * weights.reshape(-1, 1).astype(h.dtype)
    return jnp.sum(y.reshape(h.shape[0], k, -1), axis=1)


def apply_experts(h: jax.Array, experts: jax.Array, weights: jax.Array, p: dict, ops: Ops = XLA) -> jax.Array:
    """`[N, hidden]`: each token's experts (`experts [N, k]` indexes `p`'s stacked matrices)
    weighted by `weights [N, k]` and summed: by the backend's expert kernel, else gathered
    while the pairs are no more than the experts, else grouped."""
    out = _by_ops(h, experts, weights, p, ops)
    if out is not None:
        return out
    # A pair's expert costs a copy of its matrices when gathered, so gathering pays only
    # while the pairs are fewer than the experts (each then read at most once).
    return (_gathered if experts.size <= p["moe_w_gate"].shape[0] else _grouped)(h, experts, weights, p)


def moe_mlp(x: jax.Array, p: dict, config: ModelConfig, valid: jax.Array, ops: Ops = XLA):
    """The layer's experts (and shared expert) over `x [B, T, hidden]`; `valid [B, T]` marks the
    real tokens. Returns `(out [B, T, hidden], tokens_per_expert [E])`."""
    shape = x.shape
    h = x.reshape(-1, shape[-1])
    weights, experts = route(h, p["router"], config, ops)
    keep = kept_pairs(experts, valid.reshape(-1), config)
    weights = jnp.where(keep, weights, 0.0)
    out = ops.routed_experts(h, experts, weights, p)  # the experts spread over devices (expert parallel)
    if out is None:
        out = apply_experts(h, experts, weights, p, ops)
    if "shared_w_gate" in p:  # Qwen2-MoE: a dense expert every token takes, behind a sigmoid gate
        shared = ops.dense(jax.nn.silu(ops.dense(h, p["shared_w_gate"])) * ops.dense(h, p["shared_w_up"]),
                           p["shared_w_down"])
        out = out + jax.nn.sigmoid(ops.dense(h, p["shared_expert_gate"])) * shared
    return out.reshape(shape), tokens_per_expert(experts, keep, config.num_experts)
