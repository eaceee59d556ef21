"""Expert parallelism: a mixture of experts' experts spread over the mesh's "ep" axis.

The mesh is `expert_parallel x tensor_parallel` devices, axes ("ep", "tp") (sharding.py). Attention
and every other weight are laid out over "tp" alone, so with `tensor_parallel=1` they are
replicated on every expert-parallel device: each device computes every token's attention and
routing. Device `d` of "ep" holds experts `[d E/ep, (d+1) E/ep)` (each split over "tp" by its width,
as without EP). A MoE layer then, inside `shard_map`:

1. Each "ep" device takes its share of the call's tokens (`N/ep`, the call padded to a multiple).
2. Each of its (token, expert) pairs goes to the device holding that expert: one `all_to_all` of a
   `[ep, N/ep x k, hidden]` buffer (each destination's slots padded to the worst case, every pair
   to one device: XLA:CPU has no ragged all-to-all), and one of the local expert indexes.
3. Each device runs its experts over the rows it received (`moe.apply_experts`), sums the "tp"
   shards' partial products (`psum`), and sends the rows back (a second `all_to_all`).
4. Each device weights and sums its tokens' pairs, and an `all_gather` over "ep" gives every device
   the layer's output for all tokens, as attention expects.

What crosses the link per MoE layer and call, per device: two `all_to_all`s of
`ep x (N/ep) k x hidden` values (`(ep - 1) / ep` of them leave the device) and an `all_gather` of
`(ep - 1)(N/ep) x hidden`: `link_bytes_per_layer` below. The simulator prices the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from typing_extensions import override

from cbjax.models import moe
from cbjax.models.ops import Ops
from cbjax.runtime.scale.sharding import AXIS, EXPERT_AXIS, ep_size, tp_size


def link_bytes_per_layer(tokens: int, top_k: int, hidden: int, expert_parallel: int, dtype_bytes: int) -> int:
    """Bytes one device sends per MoE layer of a call of `tokens` tokens (the padded buffers)."""
    ep = expert_parallel
    if ep == 1:
        return 0
    share = -(-tokens // ep)
    exchange = 2 * ep * share * top_k * hidden * (ep - 1) // ep
    return (exchange + (ep - 1) * share * hidden) * dtype_bytes


def _dispatch_and_combine(h, experts, weights, w_gate, w_up, w_down):
    """One "ep" device's part of the layer (module docstring); all arguments as the device holds them."""
    ep = jax.lax.axis_size(EXPERT_AXIS)
    me = jax.lax.axis_index(EXPERT_AXIS)
    n, hidden = h.shape
    k, local_experts = experts.shape[1], w_gate.shape[0]
    share = -(-n // ep)
    pad = share * ep - n
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        experts, weights = jnp.pad(experts, ((0, pad), (0, 0))), jnp.pad(weights, ((0, pad), (0, 0)))
    mine = jax.lax.dynamic_slice_in_dim(h, me * share, share)
    ids = jax.lax.dynamic_slice_in_dim(experts, me * share, share).reshape(-1)
    pair_weights = jax.lax.dynamic_slice_in_dim(weights, me * share, share)
    pairs = ids.shape[0]
    dest, local_id = ids // local_experts, ids % local_experts
    slot = moe.place_in_group(dest, ep)  # the pair's place in its destination's rows
    send = jnp.zeros((ep, pairs, hidden), h.dtype).at[dest, slot].set(jnp.repeat(mine, k, axis=0))
    send_ids = jnp.full((ep, pairs), -1, jnp.int32).at[dest, slot].set(local_id)
    rows = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0).reshape(ep * pairs, hidden)
    row_ids = jax.lax.all_to_all(send_ids, EXPERT_AXIS, 0, 0).reshape(ep * pairs, 1)
    local = {"moe_w_gate": w_gate, "moe_w_up": w_up, "moe_w_down": w_down}
    out = moe.apply_experts(rows, jnp.maximum(row_ids, 0), (row_ids >= 0).astype(jnp.float32), local)
    out = jax.lax.psum(out, AXIS)  # each "tp" device computed its part of every expert's width
    back = jax.lax.all_to_all(out.reshape(ep, pairs, hidden), EXPERT_AXIS, 0, 0)
    mine_out = back[dest, slot] * pair_weights.reshape(-1, 1).astype(h.dtype)
    combined = jnp.sum(mine_out.reshape(share, k, hidden), axis=1)
    return jax.lax.all_gather(combined, EXPERT_AXIS, tiled=True)[:n]


class ExpertParallelOps(Ops):
    """XLA's operations, with a MoE layer's experts spread over `mesh`'s "ep" axis."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    @override
    def routed_experts(self, h, experts, weights, p):
        replicated, by_width, by_input = P(), P(EXPERT_AXIS, AXIS, None), P(EXPERT_AXIS, None, AXIS)
        run = jax.shard_map(_dispatch_and_combine, mesh=self.mesh, check_vma=False,
                            in_specs=(replicated, replicated, replicated, by_width, by_width, by_input),
                            out_specs=replicated)
        return run(h, experts, weights, p["moe_w_gate"], p["moe_w_up"], p["moe_w_down"])

    @override
    def __repr__(self) -> str:
        on = "" if self.platform is None else f", platform={self.platform!r}"
        return f"ExpertParallelOps(ep={ep_size(self.mesh)}, tp={tp_size(self.mesh)}{on})"


_BY_MESH: dict = {}


def expert_parallel_ops(mesh: Mesh) -> ExpertParallelOps:
    """One instance per mesh (a program's static argument: identity is equality)."""
    return _BY_MESH.setdefault(mesh, ExpertParallelOps(mesh))
