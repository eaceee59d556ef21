"""The CPU kernels of decode steps (the C++ beside this file) as JAX ops: an optional CPU backend.

`CPU_KERNELS`, the model's `Ops` (cbjax/models/ops.py) for a single-device CPU engine
(`EngineConfig.cpu_kernels`), takes two things from XLA:

- `decoder_layer`: a whole RMSNorm / RoPE / gated-SiLU layer without biases (Llama,
  Mistral, Qwen3) over at most `MAX_ROWS` rows of one token each (f32 matrices, GGUF
  Q8_0/Q4_0/Q4_1 blocks or int8; decode and the mixed step's flat rows), its keys and
  values written into the slot or paged cache in place, in one call: the layer's seven
  matmuls, attention and ~26 small XLA fusions were separate thunks of XLA's executor
  (docs/code_measurements.md);
- `dense`: the other matmuls of at most `MAX_ROWS` rows (GGUF blocks and int8 weights read
  as they are stored): the LM head; the layers of families the layer kernel
  does not take); prefill's larger ones stay with XLA's GEMM, which is as fast there;
- the history attention of one query token per row (the step's flat rows), on the slot
  and the paged cache alike, each row read only up to its own length, where the layer
  kernel does not run.

The pure-JAX code they replace is the reference (tests compare the two). The kernels are
built, cached and registered as XLA FFI targets by library.py. Without a compiler
`available()` is False and everything runs through XLA as before. They use one thread per CPU this process may run on, or
`$CBJAX_CPU_KERNEL_THREADS`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from typing_extensions import override

from cbjax.models.gguf_blocks import GGUFWeight
from cbjax.models.lora import MODULES
from cbjax.models.quant import QuantizedWeight, is_quantized
from cbjax.models.ops import Ops
from cbjax.models.params import flatten_shapes, param_shapes
# Re-exported: why the kernels are off; the CPU roofline's read loop and GEMM rate; the matmuls' two forms.
from cbjax.runtime.cpu.library import (MATMUL_KINDS, build_error, matmul_gflops, measure_crossover,  # noqa: F401
                                       pinned_form, read_sum, set_transposed, transposed_rows)

BLOCK_KINDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}  # cbjax_matmul_blocks' kind attribute
F32_KIND = 3  # an f32 matrix or norm in the layer kernel's address table (kF32)
INT8_KIND = 4  # an int8 matrix (quantization='int8') there (kI8)
# Rows (batch x tokens) up to which the kernels take a matmul (matmul.h's kMaxTransposedRows,
# blocks.h's kMaxBlockRows): decode and the mixed step. Past them (prefill) XLA's GEMM, which
# there amortizes its packing (and for GGUF or int8 weights, dequantizing once a call).
MAX_ROWS = 64

def available() -> bool:
    return build_error() is None


def _require() -> None:
    if not available():
        raise RuntimeError(f"the CPU kernels are unavailable: {build_error()}")


def _takes_rows(x: jax.Array, limit: int) -> bool:
    """Whether a kernel's matmul takes `x`: f32, 1 to `limit` rows, the kernels built."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    return x.dtype == jnp.float32 and 0 < rows <= limit and available()


def fits(x: jax.Array, w: jax.Array) -> bool:
    """Whether `x @ w.T` is the kernel's: f32, a 2-D weight, at most MAX_ROWS rows."""
    return isinstance(w, jax.Array) and w.dtype == jnp.float32 and w.ndim == 2 and _takes_rows(x, MAX_ROWS)


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` for x `[..., K]` and w `[N, K]` (f32) by the kernel."""
    _require()
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), x.dtype)
    return jax.ffi.ffi_call("cbjax_matmul_nt", out, vmap_method="sequential")(x, w)


def experts_fit(x: jax.Array, w) -> bool:
    """Whether the pairs' product with stacked experts `w [E, N, K]` is the kernel's: f32 rows, f32 experts."""
    return (isinstance(w, jax.Array) and w.dtype == jnp.float32 and w.ndim == 3 and x.ndim == 2
            and x.dtype == jnp.float32 and x.shape[0] > 0 and available())


def expert_matmul_nt(x: jax.Array, w: jax.Array, experts: jax.Array) -> jax.Array:
    """`x[p] @ w[experts[p]].T` for x `[P, K]`, w `[E, N, K]` and experts `[P]`, each expert read in place
    once for the pairs that chose it (experts.h)."""
    _require()
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    return jax.ffi.ffi_call("cbjax_expert_matmul_nt", out, vmap_method="sequential")(x, w, experts.astype(jnp.int32))


def argmax(x: jax.Array) -> jax.Array:
    """`Ops.argmax` (the first maximum of the last axis, the first NaN where there is one) by the
    kernel, for f32 `x [..., n]`, n > 0."""
    _require()
    return jax.ffi.ffi_call("cbjax_argmax", jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32),
                            vmap_method="sequential")(x)


def blocks_fit(x: jax.Array, w) -> bool:
    """Whether `x @ w.T` for a GGUF-block weight is the block kernel's: f32, at most MAX_ROWS rows."""
    return isinstance(w, GGUFWeight) and w.kind in BLOCK_KINDS and _takes_rows(x, MAX_ROWS)


def matmul_blocks(x: jax.Array, w: GGUFWeight) -> jax.Array:
    """`x @ w.T` for x `[..., K]` (f32) and a GGUF-block w `[N, K]`, the blocks widened in the kernel."""
    _require()
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), x.dtype)
    return jax.ffi.ffi_call("cbjax_matmul_blocks", out, vmap_method="sequential")(
        x, w.blocks, kind=np.int64(BLOCK_KINDS[w.kind]))


def int8_fits(x: jax.Array, w) -> bool:
    """Whether `x @ w.T` for a quantization='int8' weight is the int8 kernel's: f32, at most
    MAX_ROWS rows, groups of 32 inputs times a power of two, on the CPU."""
    return (isinstance(w, QuantizedWeight) and w.values.dtype == jnp.int8 and _int8_groups_fit(w)
            and _takes_rows(x, MAX_ROWS))


def _int8_groups_fit(w: QuantizedWeight) -> bool:
    blocks, rest = divmod(w.values.shape[-1] // w.scale.shape[-1], 32)  # a group's 32-weight blocks
    return w.values.shape[-1] % w.scale.shape[-1] == 0 and not rest and blocks > 0 and blocks & (blocks - 1) == 0


def matmul_int8(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """`x @ w.T` for x `[..., K]` (f32) and int8 w `[N, K]` with its groups' scales, widened in the kernel."""
    _require()
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.values.shape[0],), x.dtype)
    return jax.ffi.ffi_call("cbjax_matmul_int8", out, vmap_method="sequential")(x, w.values, w.scale)


def reads_cache(dtype) -> bool:
    """Whether the kernels read a KV cache of `dtype`: f32, or f16 (widened as it is read)."""
    return jnp.dtype(dtype) in (jnp.float32, jnp.float16)


def attends(q: jax.Array, layer_k: jax.Array) -> bool:
    """Whether `history_attention` takes this read: one f32 query token per row, an f32 or f16 cache."""
    return q.shape[1] == 1 and q.dtype == jnp.float32 and reads_cache(layer_k.dtype) and available()


def history_attention(q: jax.Array, cache, layer_k: jax.Array, layer_v: jax.Array, slot_ids: jax.Array,
                      lo: jax.Array, hi: jax.Array):
    """`attention_part` of one query token per row (q `[B, 1, q_heads, d]`) over the cached
    positions [lo[b], hi[b]) of row b's slot in one layer of `cache` (slot or paged). Returns
    the same triple: out `[B, kv_heads, group, 1, d]` unnormalised, max and sum
    `[B, kv_heads, group, 1]`."""
    _require()
    b, _, hq, d = q.shape
    tables, num_pages, page_size, head_stride, page_stride = cache.kernel_layout(layer_k, slot_ids)
    kv_heads = layer_k.shape[cache.head_axis]
    group = hq // kv_heads
    shapes = (jax.ShapeDtypeStruct((b, kv_heads, group, d), jnp.float32),
              jax.ShapeDtypeStruct((b, kv_heads, group), jnp.float32),
              jax.ShapeDtypeStruct((b, kv_heads, group), jnp.float32))
    out, top, total = jax.ffi.ffi_call("cbjax_history_attention", shapes, vmap_method="sequential")(
        q.reshape(b, hq, d), layer_k, layer_v, tables.astype(jnp.int32), lo.astype(jnp.int32),
        hi.astype(jnp.int32), scale=np.float32(d ** -0.5), page_size=np.int64(page_size),
        head_stride=np.int64(head_stride), page_stride=np.int64(page_stride), num_pages=np.int64(num_pages))
    return out[:, :, :, None], top[..., None], total[..., None]


_BIASES = ("bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down")


def lora_fits(lora) -> bool:
    """Whether the layer kernel takes these adapters: an f32 pool of rank at most 256, a slot per row."""
    pool = lora.pool
    return (lora.slots.ndim == 1 and pool.rank <= 256
            and all(a.dtype == jnp.float32 for a in jax.tree.leaves((pool.a, pool.b))))


def layer_fits(x: jax.Array, p, config, layer_k: jax.Array) -> bool:
    """Whether `decoder_layer` runs this layer: rows of one token (at most MAX_ROWS), f32
    weights, an f32 or f16 cache, and the RMSNorm / RoPE / gated-SiLU layer without biases (a
    `LayerAt` layer is one by construction)."""
    b, t = x.shape[:2]
    rows = (t == 1 and 0 < b <= MAX_ROWS and x.dtype == jnp.float32 and reads_cache(layer_k.dtype) and available())
    if isinstance(p, LayerAt):
        return rows
    return (rows and config.position_embedding == "rope" and not config.is_gpt2 and "w_gate" in p
            and not config.qk_norm_whole and config.clip_qkv is None
            and "bias" not in p["attn_norm"] and "bias" not in p["mlp_norm"] and not any(n in p for n in _BIASES)
            and all(getattr(p[n], "dtype", None) == jnp.float32
                    for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")))


def _layer_call(target, x, weights, config, cache, layer_k, layer_v, slot_ids, positions, num_valid, cos, sin,
                window, tail=(), **attributes):
    """One `target` layer call: `x [B, 1, hidden]` -> `(x, layer_k, layer_v)`, the caches
    (the arguments right after `weights`, cos and sin) updated in place; `tail`: operands after
    the rows' (a LoRA pool's)."""
    _require()
    b = x.shape[0]
    tables, num_pages, page_size, head_stride, page_stride = cache.kernel_layout(layer_k, slot_ids)
    shapes = (jax.ShapeDtypeStruct((b, config.hidden_size), jnp.float32),
              jax.ShapeDtypeStruct(layer_k.shape, layer_k.dtype), jax.ShapeDtypeStruct(layer_v.shape, layer_v.dtype))
    first_cache = 1 + len(weights) + 2
    # The caches are the call's results 1 and 2: XLA updates them in place.
    out, layer_k, layer_v = jax.ffi.ffi_call(target, shapes, vmap_method="sequential",
                                             input_output_aliases={first_cache: 1, first_cache + 1: 2})(
        x.reshape(b, -1), *weights, cos.reshape(b, -1), sin.reshape(b, -1), layer_k, layer_v,
        tables.astype(jnp.int32), positions.reshape(b).astype(jnp.int32), (num_valid > 0).astype(jnp.int32), *tail,
        eps=np.float32(config.norm_eps), scale=np.float32(config.head_dim ** -0.5),
        num_heads=np.int64(config.num_heads), num_kv_heads=np.int64(config.num_kv_heads), window=np.int64(window),
        page_size=np.int64(page_size), head_stride=np.int64(head_stride), page_stride=np.int64(page_stride),
        num_pages=np.int64(num_pages), **attributes)
    return out.reshape(x.shape), layer_k, layer_v


def decoder_layer(x, p, config, cache, layer_k, layer_v, slot_ids, positions, num_valid, cos, sin, window,
                  lora=None):
    """One decoder layer by the kernel for `x [B, 1, hidden]`: `(x, layer_k, layer_v)`, the
    rows' keys and values written into the layer's cache in place. Equals the transformer's
    layer (its reference) on rows whose tokens are valid. `p`: the layer's weights, or its
    row of a `LayerAddresses` table. `lora`: (`TokenAdapters`, model layer), each row's LoRA
    adapter added inside the kernel (lora.h; `p` a `LayerAt` only)."""
    rest = (config, cache, layer_k, layer_v, slot_ids, positions, num_valid, cos, sin, window)
    if isinstance(p, LayerAt):
        shape = dict(layer=np.int64(p.index), intermediate=np.int64(config.intermediate_size),
                     head_dim=np.int64(config.head_dim))
        if lora is None:
            return _layer_call("cbjax_decoder_layer_at", x, [p.table], *rest, **shape)
        # The pool's stacked arrays whole (a slice would be copied for the call), read at `layer`
        # (the table's row: the model's layer, as no pipeline stage serves adapters).
        pool, none = lora.pool, jnp.zeros((1,), jnp.float32)
        tail = [lora.slots.reshape(-1).astype(jnp.int32), pool.scale]
        for module in LORA_MODULES:
            tail += [pool.a[module], pool.b[module]] if module in pool.a else [none, none]
        return _layer_call("cbjax_decoder_layer_at_lora", x, [p.table], *rest, tail=tail, **shape,
                           rank=np.int64(pool.rank),
                           modules=np.int64(sum(1 << i for i, m in enumerate(LORA_MODULES) if m in pool.a)))
    one = jnp.ones((config.head_dim,), jnp.float32)
    weights = [p["attn_norm"]["scale"], p["wq"], p["wk"], p["wv"], p["wo"], p.get("q_norm", one),
               p.get("k_norm", one), p["mlp_norm"]["scale"], p["w_gate"], p["w_up"], p["w_down"]]
    return _layer_call("cbjax_decoder_layer", x, weights, *rest, qk_norm=bool(config.qk_norm))


# ---------------------------------------------------------------- weights by address

LORA_MODULES = MODULES  # the order of the adapter pools the layer kernel takes (layer_lora.h)

# A layer's weights in the order of the kernel's LayerWeights (layer.h).
LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class LayerAt:
    """Layer `index` of a `LayerAddresses` table, as `forward` hands it to `decoder_layer`."""

    table: jax.Array
    index: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerAddresses:
    """The decoder layers' weights as one table of addresses (`[layers, 66]` uint32: each
    weight's address as low and high halves, 0 for an absent q/k norm, its kind (F32_KIND, a
    GGUF block kind of BLOCK_KINDS or INT8_KIND), and for int8 its scales' address and group),
    which stands for `params["layers"]` in the programs whose every layer `decoder_layer` runs.

    Why: JAX's dispatch costs per argument on this path (flattening, signature, layout and
    usage events per array), and SmolLM2's decode step took 272 weight arrays: serial host
    time before each step (docs/code_measurements.md). The table is one argument. The kernel reads the
    weights where JAX keeps them: whoever holds a table holds the arrays it names (the
    engine keeps its params), and weights are never donated or written."""

    table: jax.Array

    def __len__(self) -> int:
        return self.table.shape[0]

    def __iter__(self):
        return (LayerAt(self.table, i) for i in range(len(self)))


def _kind(a, shape: tuple) -> int | None:
    """A layer weight's kind in the address table, or None where the layer kernel cannot read it:
    f32 arrays, GGUF blocks of the kernel's kinds whose rows are whole 32-weight blocks, and
    int8 weights whose groups the kernel takes."""
    if isinstance(a, GGUFWeight):
        fits = a.kind in BLOCK_KINDS and a.shape == shape and shape[-1] % 32 == 0
        return BLOCK_KINDS[a.kind] if fits and _on_cpu(a.blocks) else None
    if isinstance(a, QuantizedWeight):
        fits = a.values.dtype == jnp.int8 and a.values.shape == shape and _int8_groups_fit(a)
        return INT8_KIND if fits and _on_cpu(a.values) and _on_cpu(a.scale) else None
    return F32_KIND if isinstance(a, jax.Array) and a.dtype == jnp.float32 and a.shape == shape and _on_cpu(a) else None


def _on_cpu(a: jax.Array) -> bool:
    return a.devices() == {jax.devices("cpu")[0]}


def layer_addresses(params: dict, config) -> LayerAddresses | None:
    """`params["layers"]` as a `LayerAddresses` table when the layer kernel takes every layer
    (Llama / Mistral / Qwen3 layers without biases, f32, Q8_0/Q4_0/Q4_1 GGUF or int8 matrices, on
    the CPU), else None."""
    layers = params["layers"]
    # The config's layer (`param_shapes`), by the kernel's names: norms are their scales.
    layer_shapes = flatten_shapes(param_shapes(config)["layers"][0])
    expected = {n.removesuffix("/scale"): shape for n, shape in layer_shapes.items()}
    required = set(LAYER_WEIGHTS) - {"q_norm", "k_norm"}
    if (not layers or not available() or config.position_embedding != "rope" or not required <= set(expected)
            or config.qk_norm_whole or config.clip_qkv is not None
            or not set(expected) <= set(LAYER_WEIGHTS)):
        return None  # biases, ungated MLP or learned positions: a layer the kernel does not run
    rows = []
    for p in layers:
        if set(p) != set(expected) or len(jax.tree.leaves(p, is_leaf=is_quantized)) != len(expected):
            return None  # a layer of another shape than the config's
        arrays = {n: p[n]["scale"] if n in ("attn_norm", "mlp_norm") else p[n] for n in expected}
        kinds = {n: _kind(a, expected[n]) for n, a in arrays.items()}
        if None in kinds.values() or any(kinds[n] != F32_KIND for n in arrays if "norm" in n):
            return None
        row = []
        for n in LAYER_WEIGHTS:
            a = arrays.get(n)
            data = a.blocks if isinstance(a, GGUFWeight) else a.values if isinstance(a, QuantizedWeight) else a
            address = 0 if a is None else data.unsafe_buffer_pointer()
            scales, group = (a.scale.unsafe_buffer_pointer(), a.values.shape[-1] // a.scale.shape[-1]) if (
                isinstance(a, QuantizedWeight)) else (0, 0)
            row += [address & 0xFFFFFFFF, address >> 32, kinds.get(n, F32_KIND), scales & 0xFFFFFFFF, scales >> 32,
                    group]
        rows.append(row)
    return LayerAddresses(jnp.asarray(np.array(rows, np.uint32)))


class CpuKernelOps(Ops):
    """The model's operations with the C++ kernels where they fit, XLA's elsewhere."""

    @override
    def dense(self, x, w):
        if blocks_fit(x, w):
            return matmul_blocks(x, w)
        if int8_fits(x, w):
            return matmul_int8(x, w)
        return matmul_nt(x, w) if fits(x, w) else super().dense(x, w)

    @override
    def expert_dense(self, x, w, experts):
        return expert_matmul_nt(x, w, experts) if experts_fit(x, w) else super().expert_dense(x, w, experts)

    @override
    def lora_delta(self, x, a, b, scale, slots, layer):
        if not (available() and x.dtype == jnp.float32 and a.dtype == jnp.float32 and a.shape[2] <= 256):
            return super().lora_delta(x, a, b, scale, slots, layer)
        return jax.ffi.ffi_call("cbjax_lora_delta", jax.ShapeDtypeStruct((x.shape[0], b.shape[2]), jnp.float32),
                                vmap_method="sequential")(x, a, b, scale, slots.astype(jnp.int32),
                                                          layer=np.int64(layer))

    @override
    def argmax(self, x):
        if x.dtype == jnp.float32 and x.ndim >= 1 and x.shape[-1] > 0 and available():
            return argmax(x)
        return super().argmax(x)

    @override
    def history_attention(self, q, cache, layer_k, layer_v, slot_ids, lo, hi):
        if not attends(q, layer_k):
            return None
        return history_attention(q, cache, layer_k, layer_v, slot_ids, lo, hi)

    @override
    def decoder_layer(self, x, p, config, cache, layer_k, layer_v, slot_ids, positions, num_valid, cos, sin, window,
                      lora=None):
        if not layer_fits(x, p, config, layer_k):
            if isinstance(p, LayerAt):  # the weights exist only as addresses: nothing else can run them
                raise ValueError(f"weights by address need the layer kernel, which does not take rows {x.shape}")
            return None
        if lora is not None and not (isinstance(p, LayerAt) and lora_fits(lora)):
            if isinstance(p, LayerAt):
                raise ValueError("weights by address with LoRA adapters the layer kernel does not take")
            return None  # the layer's operations one by one, each adding its adapters (models/lora.py)
        return decoder_layer(x, p, config, cache, layer_k, layer_v, slot_ids, positions, num_valid, cos, sin, window,
                             lora)


CPU_KERNELS = CpuKernelOps()
