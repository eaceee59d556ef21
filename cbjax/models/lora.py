"""Many LoRA adapters in one batch (Punica's BGMV, S-LoRA's unified pool): a fixed device pool
of adapter slots, and each token's projection plus its own adapter's low-rank product.

The pool holds `slots` adapters padded to one rank, the way the KV cache holds sequences:
slot 0 is the base model (all zeros, scale 0), loading an adapter writes its slot in place,
and which adapter a token reads is data (`adapters [N]`, a slot per token), never part of a
program's key, so loading, unloading or mixing adapters compiles nothing. A projection
`y = x @ W.T` of the targets the pool holds becomes `y + scale[i] * (x @ A[i].T) @ B[i].T`
for the token's slot `i`: each token gathers its adapter's `A` and `B` (BGMV), so any mix of
adapters runs in one program and a slot no token names is never read. Ranks below the pool's
are zero-padded; the padding's zeros add nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cbjax.config import ModelConfig

# The projections an adapter may target, by PEFT's module names.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraPool:
    """`a[module] [layers, slots, rank, in]`, `b[module] [layers, slots, out, rank]` and
    `scale [slots]` (float32); slot 0 is no adapter."""

    a: dict
    b: dict
    scale: jax.Array

    @property
    def num_slots(self) -> int:
        return self.scale.shape[0]

    @property
    def rank(self) -> int:
        return next(iter(self.a.values())).shape[2]

    @classmethod
    def init(cls, shapes: dict[str, tuple[int, int]], num_layers: int, num_slots: int, rank: int,
             dtype=jnp.float32) -> "LoraPool":
        """An empty pool for modules `shapes` (PEFT name -> (in, out)) of `num_slots` slots (the
        base model's included)."""
        a = {m: jnp.zeros((num_layers, num_slots, rank, fan_in), dtype) for m, (fan_in, _) in shapes.items()}
        b = {m: jnp.zeros((num_layers, num_slots, fan_out, rank), dtype) for m, (_, fan_out) in shapes.items()}
        return cls(a, b, jnp.zeros((num_slots,), jnp.float32))


def write_slot(pool: LoraPool, slot, a: dict, b: dict, scale) -> LoraPool:
    """`pool` with slot `slot` holding an adapter: `a[module] [layers, rank, in]`, `b[module]
    [layers, out, rank]` for every module of the pool (zeros where the adapter has none)."""
    def put(stacked, value):
        return jax.lax.dynamic_update_slice_in_dim(stacked, value[:, None].astype(stacked.dtype), slot, axis=1)

    return LoraPool({m: put(pool.a[m], a[m]) for m in pool.a}, {m: put(pool.b[m], b[m]) for m in pool.b},
                    pool.scale.at[slot].set(scale))


@dataclasses.dataclass(frozen=True)
class TokenAdapters:
    """What a forward's layers need to add each token's adapter: the pool and each token's
    slot (`[B]`, the forward's rows of one token each, or `[B, T]`)."""

    pool: LoraPool
    slots: jax.Array
    ops: object  # the backend's operations (`Ops.lora_delta`: XLA's gather, or the CPU kernel)

    def add(self, y: jax.Array, x: jax.Array, module: str, layer: int) -> jax.Array:
        """`y` (the base projection of `x`) plus each token's adapter on `module`, where the pool holds it."""
        if module not in self.pool.a:
            return y
        slots = jnp.broadcast_to(self.slots.reshape(self.slots.shape + (1,) * (x.ndim - 1 - self.slots.ndim)),
                                 x.shape[:-1])
        # Each token reads only its own adapter, rank x (in + out) values: a decode token's share
        # of the pool is its adapter's bytes (BGMV), whatever the pool holds.
        delta = self.ops.lora_delta(x.reshape(-1, x.shape[-1]), self.pool.a[module], self.pool.b[module],
                                    self.pool.scale, slots.reshape(-1), layer)
        return y + delta.reshape(y.shape).astype(y.dtype)


def layer_adapters(params: dict, slots: jax.Array | None, ops) -> TokenAdapters | None:
    """The forward's adapters: `params["lora"]` (an engine's pool) read at `slots` by `ops`, or
    None when either is missing (the base model alone)."""
    pool = params.get("lora")
    if pool is None or slots is None:
        return None
    return TokenAdapters(pool, slots, ops)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may target in this family (PEFT's module names):
    none in GPT-2 (its fused Conv1D projections), the attention's alone in a mixture of experts."""
    if config.is_gpt2:
        return {}
    hd, d = config.head_dim, config.hidden_size
    shapes = {"q_proj": (d, config.num_heads * hd), "k_proj": (d, config.num_kv_heads * hd),
              "v_proj": (d, config.num_kv_heads * hd), "o_proj": (config.num_heads * hd, d)}
    if not config.is_moe:
        shapes.update(gate_proj=(d, config.intermediate_size), up_proj=(d, config.intermediate_size),
                      down_proj=(config.intermediate_size, d))
    return shapes


def adapter_bytes(config: ModelConfig, rank: int, modules, itemsize: int = 4) -> int:
    """Bytes of one adapter's A and B of `rank` on `modules` over every layer."""
    shapes = module_shapes(config)
    return itemsize * config.num_layers * sum(rank * (shapes[m][0] + shapes[m][1]) for m in modules)
