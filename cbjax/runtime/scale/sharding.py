"""Tensor parallelism on a `jax.sharding.Mesh`: which axis of each array is split.

The engine's programs stay the same jitted functions; only their inputs carry
shardings, and XLA's partitioner (GSPMD) inserts the collectives. The layout is
Megatron's: attention by heads and the MLP by its width, so each layer needs one
all-reduce after `wo` and one after `w_down`.

- `wq`/`bq` by query heads, `wo` by its input (query heads) columns.
- `wk`/`wv`/`bk`/`bv` and the KV cache by KV heads, when the tensor-parallel size
  divides the KV head count. Otherwise (a GQA model with fewer KV heads than devices,
  or a count it does not divide) they are replicated: every device holds every KV
  head and computes K/V for all of them, which costs memory but keeps each device's
  query heads next to the keys they read. vLLM instead replicates each KV head over
  `tp / kv_heads` devices; under GSPMD full replication is the simple, correct rule.
- `w_gate`/`w_up`/`b_gate`/`b_up` by the MLP width, `w_down` by its input columns.
- A mixture of experts' layer (cbjax/models/moe.py) the same way inside each expert: every device
  holds every expert, `moe_w_gate`/`moe_w_up` split by the expert's width and `moe_w_down` by its
  input columns, so routing needs no exchange and the layer one all-reduce; the router is
  replicated. Qwen2-MoE's shared expert is split like a dense MLP.
- Embeddings, norms, the LM head and every small per-slot array are replicated.

The query head count and the MLP widths must be divisible by the tensor-parallel size.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cbjax import checks
from cbjax.config import ModelConfig
from cbjax.models.quant import QuantizedWeight

AXIS = "tp"
EXPERT_AXIS = "ep"  # expert parallelism (cbjax/runtime/scale/expert_parallel.py): a mesh of ep x tp devices

# The split axis of each per-layer tensor; absent ones are replicated.
_COLUMN = ("wq", "bq", "w_gate", "w_up", "b_gate", "b_up", "shared_w_gate", "shared_w_up")  # the output axis
_ROW = ("wo", "w_down", "shared_w_down", "moe_w_down")  # the input axis (the last of [(experts,) out, in])
_EXPERT_COLUMN = ("moe_w_gate", "moe_w_up")  # [experts, width, hidden]: the width
_KV = ("wk", "wv", "bk", "bv")  # the output axis, when KV heads are split


def tensor_parallel_mesh(tensor_parallel: int, devices=None, expert_parallel: int = 1) -> Mesh:
    """A one-axis ("tp") mesh over the first `tensor_parallel` of `devices` (default: every
    device of every process, as `jax.devices()` lists them); with `expert_parallel` > 1, a
    two-axis ("ep", "tp") mesh of `expert_parallel x tensor_parallel` devices, each "tp" group
    neighbouring devices."""
    devices = list(jax.devices() if devices is None else devices)
    tensor_parallel = checks.integer("tensor_parallel", tensor_parallel, 1)
    expert_parallel = checks.integer("expert_parallel", expert_parallel, 1)
    needed = tensor_parallel * expert_parallel
    if needed > len(devices):
        raise ValueError(f"tensor_parallel={tensor_parallel} x expert_parallel={expert_parallel} needs {needed} "
                         f"devices, {len(devices)} are available")
    if expert_parallel == 1:
        return Mesh(np.array(devices[:tensor_parallel]), (AXIS,))
    return Mesh(np.array(devices[:needed]).reshape(expert_parallel, tensor_parallel), (EXPERT_AXIS, AXIS))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[AXIS]


def ep_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else dict(mesh.shape).get(EXPERT_AXIS, 1)


def check_divisible(config: ModelConfig, mesh: Mesh) -> None:
    n = tp_size(mesh)
    for name, size in (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size),
                       ("moe_intermediate_size", config.moe_intermediate_size),
                       ("shared_expert_intermediate_size", config.shared_expert_intermediate_size)):
        if size % n:
            raise ValueError(f"tensor_parallel={n} must divide the model's {name} ({size})")
    config.check_expert_parallel(ep_size(mesh))


def kv_heads_split(config: ModelConfig, mesh: Mesh | None) -> bool:
    """Whether the KV heads (and so the KV cache) are split over the mesh, or replicated."""
    return mesh is not None and config.num_kv_heads % tp_size(mesh) == 0


def param_specs(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """A PartitionSpec per leaf of `params` (the layout in cbjax/models/params.py)."""
    split_kv = kv_heads_split(config, mesh)
    by_expert = ep_size(mesh) > 1

    def spec(name: str, leaf):
        axes = [None] * leaf.ndim
        if by_expert and name.startswith("moe_w_"):
            axes[0] = EXPERT_AXIS
        if name in _COLUMN or (split_kv and name in _KV):
            axes[0] = AXIS
        elif name in _ROW:
            axes[-1] = AXIS
        elif name in _EXPERT_COLUMN:
            axes[1] = AXIS
        if isinstance(leaf, QuantizedWeight):  # scales [out, groups]: split as the rows and inputs are
            return QuantizedWeight(P(*axes), P(*axes))
        return P(*axes)

    layers = [{name: spec(name, leaf) if not isinstance(leaf, dict) else jax.tree.map(lambda x: P(), leaf)
               for name, leaf in layer.items()} for layer in params["layers"]]
    out = {k: jax.tree.map(lambda x: P(), v) for k, v in params.items() if k != "layers"}
    out["layers"] = layers
    return out


def place(tree, shardings):
    """Put host (or single-device) arrays at `shardings`. Works across processes: each
    process supplies the shards its devices hold, from its own full copy."""
    def put(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def shard_params(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    check_divisible(config, mesh)
    specs = param_specs(params, config, mesh)
    return place(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                      is_leaf=lambda x: isinstance(x, P)))


def kv_sharding(config: ModelConfig, mesh: Mesh, head_axis: int, ndim: int) -> NamedSharding:
    """The KV cache's sharding: its KV-head axis split when `kv_heads_split`, else replicated."""
    axes = [None] * ndim
    if kv_heads_split(config, mesh):
        axes[head_axis] = AXIS
    return NamedSharding(mesh, P(*axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
