"""The model's replaceable operations: what a backend may do its own way.

`forward` takes an `Ops` as a static argument (one instance per backend), so a
backend choice is part of a program's key but not of the model's config. `Ops` itself is
XLA's way and the reference: a backend (cbjax/runtime/cpu/kernels.py, the C++ CPU
kernels) subclasses it and says, per call, whether it takes the work or leaves it here.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
from typing_extensions import override

from cbjax.models import gguf_blocks, quant


class Ops:
    # The one platform a program is traced for ("cpu", "gpu", "cuda", "rocm", "tpu"), or None:
    # any, each platform's way chosen when the program is lowered (`platform_dependent`).
    platform: str | None = None

    def on(self, platform: str | None) -> "Ops":
        """These operations traced for `platform` alone (see `platform`): one instance per
        (backend, platform), so identity stays equality. A program traced for one platform
        holds only that platform's branches, where `platform_dependent` traces every platform's
        (both sides of each of the sampler's skips twice over, the attention kernel's three bodies)."""
        base = self._base if self.platform is not None else self
        if platform is None:
            return base
        variants = base.__dict__.setdefault("_on", {})
        if platform not in variants:
            variant = copy.copy(base)
            variant.__dict__.pop("_on", None)
            variant.platform, variant._base = platform, base
            variants.setdefault(platform, variant)
        return variants[platform]

    def dense(self, x: jax.Array, w) -> jax.Array:
        """`x @ w.T` for a weight stored `[out, in]` (see cbjax/models/params.py), or a
        `quant.QuantizedWeight` or `gguf_blocks.GGUFWeight` of that shape."""
        if isinstance(w, quant.QuantizedWeight):
            return quant.dense(x, w)
        if isinstance(w, quant.GGUFWeight):
            return gguf_blocks.dense(x, w)
        return jnp.einsum("...d,od->...o", x, w)

    def routed_experts(self, h: jax.Array, experts: jax.Array, weights: jax.Array, p: dict) -> jax.Array | None:
        """A mixture-of-experts layer's experts for tokens `h [N, hidden]` routed to `experts [N, k]`
        with `weights [N, k]` (cbjax/models/moe.py), where a backend spreads them over devices
        (cbjax/runtime/scale/expert_parallel.py), or None: `moe.apply_experts` on this device."""
        del h, experts, weights, p
        return None

    def expert_dense(self, x: jax.Array, w, experts: jax.Array) -> jax.Array | None:
        """`x[p] @ w[experts[p]].T` for pairs' rows `x [P, K]` and stacked experts `w [E, N, K]`,
        or None to leave it to the mixture-of-experts layer's own ways (cbjax/models/moe.py)."""
        del x, w, experts
        return None

    def lora_delta(self, x: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array, slots: jax.Array,
                   layer: int) -> jax.Array:
        """Each row's LoRA adapter on one module: `scale[s] * (x[n] @ A[s].T) @ B[s].T` for rows
        `x [N, in]` of slots `slots [N]`, the pool `a [layers, S, rank, in]`, `b [layers, S, out, rank]`
        read at `layer` (cbjax/models/lora.py). XLA's way: each row gathers its adapter (BGMV)."""
        a, b = a[layer][slots], b[layer][slots]
        low = jnp.einsum("nd,nrd->nr", x.astype(a.dtype), a) * scale[slots][:, None].astype(a.dtype)
        return jnp.einsum("nr,nor->no", low, b)

    def history_attention(self, q, cache, layer_k, layer_v, slot_ids, lo, hi):
        """`attention_part` of one query token per row over cached positions [lo, hi) of each
        row's slot, or None to leave it to the reference read (cbjax/models/transformer.py)."""
        del q, cache, layer_k, layer_v, slot_ids, lo, hi
        return None

    def decoder_layer(self, x, p, config, cache, layer_k, layer_v, slot_ids, positions, num_valid, cos, sin, window,
                      lora=None):
        """A whole decoder layer over rows of one token each (`x [B, 1, hidden]`, the chunk's
        keys written into `layer_k`/`layer_v`; `lora`: each row's LoRA adapters, a
        `TokenAdapters` or None): `(x, layer_k, layer_v)` after it, or None to leave it to the
        layer's operations one by one (cbjax/models/transformer.py)."""
        del x, p, config, cache, layer_k, layer_v, slot_ids, positions, num_valid, cos, sin, window, lora
        return None

    def argmax(self, x: jax.Array) -> jax.Array:
        """`jnp.argmax(x, -1)` as int32 (the first maximum; the first NaN where there is one), by
        two plain reductions: XLA:CPU runs argmax's (value, index) reduce one element at a time
        (docs/code_measurements.md)."""
        top = jnp.max(x, axis=-1, keepdims=True)
        hit = (x == top) | jnp.isnan(x)
        return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)

    # One instance per backend (module singletons), so identity is equality: a jit hashes
    # this static argument on every call, and object's own hash costs no Python frame.

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}({'' if self.platform is None else f'platform={self.platform!r}'})"


XLA = Ops()
