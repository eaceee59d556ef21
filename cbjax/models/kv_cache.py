"""KV caches as registered pytree dataclasses.

Keys and values are one array per layer (a tuple of `num_layers` arrays), as the
weights are (cbjax/models/params.py): the forward writes each layer's new positions
into that layer's own donated buffer with one in-place scatter and reads it back,
with no loop-carried stacked cache for XLA to copy around the reads. (A stacked
`[layers, ...]` cache, written per layer inside the layer loop or once after it,
made XLA:CPU copy the whole cache in every decode step: docs/code_measurements.md.)

`SlotCache` is the fixed-slot layout: every slot reserves `max_len` positions, each
layer's keys `[kv_heads, slots, max_len, head_dim]`. Heads come first and positions
before head_dim, as in the paged layout's `[kv_heads, pages, page_size, head_dim]`:
attention reads each head's keys of a slot as one contiguous `[length, head_dim]`
matrix (faster than the position-major order on CPU), and a slot is a run of
`max_len / page_size` consecutive pages of a pool, so the ragged attention kernel reads
both layouts (`kernel_view`). `lengths[slot]` is how many positions of a slot hold a
valid sequence.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.config import ModelConfig
from cbjax.models.quant import ScaledValues


KV_DTYPES = ("auto", "float16", "bfloat16", "int8", "fp8")  # EngineArgs.kv_cache_dtype: auto is the model's dtype
_KV_FORMATS = {"int8": 127.0, "float8_e4m3fn": 448.0}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype):
    """The dtype a cache stores its keys and values in."""
    return {"auto": jnp.dtype(model_dtype), "float16": jnp.dtype(jnp.float16), "bfloat16": jnp.dtype(jnp.bfloat16),
            "int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}[kv_cache_dtype]


def is_quantized_kv(dtype) -> bool:
    return jnp.dtype(dtype).name in _KV_FORMATS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKV(ScaledValues):
    """One layer's keys (or values) in 8 bits with a float32 scale per position and head: the
    vector at `[h, i, p]` is `values[h, i, p] * scale[h, i, p, 0]`. The scale keeps a trailing
    axis of 1 so that every index, slice and reshape of the layer (`jax.tree.map` over both)
    is the same on the scale as on the values."""

    values: jax.Array  # [kv_heads, slots | pages, positions, head_dim] int8 / float8_e4m3fn
    scale: jax.Array  # [kv_heads, slots | pages, positions, 1] float32


@functools.lru_cache(maxsize=None)
def kv_rotation(head_dim: int) -> np.ndarray:
    """The orthonormal `[head_dim, head_dim]` rotation an 8-bit cache stores its vectors in:
    Sylvester's Hadamard matrix / sqrt(head_dim) (symmetric, its own inverse) for a power of two,
    else a fixed random orthogonal matrix. A few channels of a head carry most of a key's
    magnitude; one scale per vector then leaves the other channels a handful of levels. Rotated,
    every channel holds an even share, and q.k and p.v are unchanged when q is rotated alike and
    the output rotated back (QuaRot's observation). SmolLM2-135M, fp8 KV: +3.1% perplexity
    against bf16 KV unrotated, -0.6% rotated (docs/quantization.md)."""
    if head_dim & (head_dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        return (h / np.sqrt(head_dim)).astype(np.float32)
    q, r = np.linalg.qr(np.random.default_rng(head_dim).standard_normal((head_dim, head_dim)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def rotate(x: jax.Array, head_dim: int, back: bool = False) -> jax.Array:
    """`x [..., head_dim]` into an 8-bit cache's rotated basis (or `back` out of it), in f32."""
    r = jnp.asarray(kv_rotation(head_dim))
    return (x.astype(jnp.float32) @ (r.T if back else r)).astype(x.dtype)


def encode(new: jax.Array, like) -> object:
    """`new [..., head_dim]` in `like`'s storage: its dtype, or quantized per vector."""
    if not isinstance(like, QuantizedKV):
        return new.astype(like.dtype)
    top = _KV_FORMATS[like.dtype.name]
    x = new.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak / top, 1.0)
    scaled = x / scale
    values = jnp.clip(jnp.round(scaled), -top, top) if like.dtype == jnp.int8 else scaled
    return QuantizedKV(values.astype(like.dtype), scale)


def decode(stored) -> jax.Array:
    """Keys or values as arrays: a quantized layer's (or a slice's) in float32."""
    if isinstance(stored, QuantizedKV):
        return stored.values.astype(jnp.float32) * stored.scale
    return stored


def as_stored(new: jax.Array, like) -> jax.Array:
    """`new` as a read of `like`'s storage would give it back (so a chunk's own keys count as
    its cached ones do): through 8 bits and back for a quantized layer, through a narrower
    float (f16 under f32) and back, else unchanged."""
    if isinstance(like, QuantizedKV):
        return decode(encode(new, like)).astype(new.dtype)
    return new.astype(like.dtype).astype(new.dtype) if like.dtype != new.dtype else new


def _zeros_per_layer(num_layers: int, shape: tuple, dtype) -> tuple:
    if is_quantized_kv(dtype):
        return tuple(QuantizedKV(jnp.zeros(shape, dtype), jnp.ones(shape[:-1] + (1,), jnp.float32))
                     for _ in range(num_layers))
    return tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))


def _set(layer, index: tuple, new: jax.Array):
    """`layer.at[index].set(new, mode="drop")` for an array or a QuantizedKV (`new` encoded)."""
    return jax.tree.map(lambda a, n: a.at[index].set(n, mode="drop"), layer, encode(new, layer))


def _scatter_rows(index: jax.Array, positions: jax.Array, new: jax.Array, dropped: int):
    """Add a dropped second row when `new` is a single `[1, 1, ...]` row. XLA turns a
    one-row scatter into a dynamic-update-slice, duplicates that into the layer's read,
    and must then keep the old buffer alive past the in-place update: it copied every
    layer's cache twice per decode step of one sequence (120 copies per SmolLM2 step).
    Two rows stay a scatter, updated in place as at any other batch size."""
    if new.shape[0] * new.shape[1] != 1:
        return index, positions, new
    pair = lambda a: jnp.concatenate([a, a], axis=1)  # noqa: E731
    return jnp.concatenate([index, jnp.full_like(index, dropped)], axis=1), pair(positions), pair(new)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotCache:
    k: tuple  # per layer: [kv_heads, slots, max_len, head_dim]
    v: tuple  # per layer: [kv_heads, slots, max_len, head_dim]
    lengths: jax.Array  # [slots] int32
    # Static: where each layer's k and v live on a tensor-parallel mesh (cbjax/sharding.py), or None.
    kv_sharding: object = dataclasses.field(default=None, metadata=dict(static=True))
    head_axis = 0  # of one layer's array

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[1]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @staticmethod
    def layer_shape(config: ModelConfig, num_slots: int, max_len: int) -> tuple:
        return (config.num_kv_heads, num_slots, max_len, config.head_dim)

    @classmethod
    def init(cls, config: ModelConfig, num_slots: int, max_len: int, dtype=jnp.float32) -> "SlotCache":
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be positive, got {num_slots}, {max_len}")
        shape = cls.layer_shape(config, num_slots, max_len)
        return cls(k=_zeros_per_layer(config.num_layers, shape, dtype),
                   v=_zeros_per_layer(config.num_layers, shape, dtype),
                   lengths=jnp.zeros((num_slots,), jnp.int32))

    @staticmethod
    def bytes_per_slot(config: ModelConfig, max_len: int, dtype=jnp.float32, scaled: bool | None = None) -> int:
        """Bytes of `max_len` positions at `dtype`; `scaled` (default: an 8-bit dtype) adds each
        vector's f32 scale, as this cache stores it (a simulated fp8 cache has none)."""
        vectors = 2 * config.num_layers * config.num_kv_heads * max_len
        scaled = is_quantized_kv(dtype) if scaled is None else scaled
        return vectors * (config.head_dim * jnp.dtype(dtype).itemsize + (4 if scaled else 0))

    def write(self, cache: jax.Array, slot_ids, starts, num_valid, new: jax.Array) -> jax.Array:
        """Scatter `new[b, :num_valid[b]]` (`[B, T, kv_heads, hd]`) into one layer's cache at
        `[:, slot_ids[b], starts[b] + t]`, in place; padding (and anything past `max_len`)
        goes to an out-of-range slot and is dropped."""
        t = new.shape[1]
        positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        valid = (jnp.arange(t)[None, :] < num_valid[:, None]) & (positions < self.max_len)
        slots = jnp.where(valid, slot_ids[:, None], self.num_slots)
        slots, positions, new = _scatter_rows(slots, positions, new, self.num_slots)
        # cache[:, slots, positions] with adjacent [B, T] index arrays indexes [kv_heads, B, T, hd]
        return _set(cache, (slice(None), slots, positions), new.transpose(2, 0, 1, 3))

    def read(self, cache: jax.Array, slot_ids, kv_len: int, all_slots: bool) -> jax.Array:
        """One layer's keys (or values) of rows `slot_ids`: `[B, kv_heads, kv_len, head_dim]`."""
        if all_slots:  # decode: every slot in order, a plain slice (fused into the attention, no copy)
            return decode(jax.tree.map(lambda a: a[:, :, :kv_len].swapaxes(0, 1), cache))
        return decode(jax.tree.map(lambda a: a[:, slot_ids, :kv_len].swapaxes(0, 1), cache))

    def read_block(self, cache: jax.Array, slot_ids, at, size: int) -> jax.Array:
        """Positions `[at, at + size)` of rows `slot_ids` (`at` traced, `at + size <= max_len`):
        `[B, kv_heads, size, head_dim]`."""
        return decode(jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, at, size, axis=2)[:, slot_ids]
                                   .swapaxes(0, 1), cache))

    def get_sequence(self, slot: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of one slot, `[layers, kv_heads, length, head_dim]` (host-side helper)."""
        n = int(self.lengths[slot])

        def held(layer):  # an 8-bit layer's vectors rotated back (forward stored them rotated)
            x = decode(jax.tree.map(lambda a: a[:, slot, :n], layer))
            return rotate(x, x.shape[-1], back=True) if isinstance(layer, QuantizedKV) else x

        return tuple(jnp.stack([held(layer) for layer in kv]) for kv in (self.k, self.v))

    # One sequence out and in (a KV move between engines), and copies (a fork's prompt).
    paged = False

    def transfer_unit(self, padded: int) -> int:
        """Positions per entry of a sequence's transfer table: the whole slot is one."""
        return padded

    @property
    def no_page(self) -> int:
        return 0

    def sequence_out(self, layer: jax.Array, slot, pages, padded: int) -> jax.Array:
        """One layer's first `padded` positions of `slot`: `[kv_heads, padded, head_dim]`."""
        del pages
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a[:, slot], 0, padded, axis=1), layer)

    def sequence_in(self, layer: jax.Array, new: jax.Array, slot, pages) -> jax.Array:
        """`new` (`[kv_heads, padded, head_dim]`) written as `slot`'s first positions, in place."""
        del pages
        return jax.tree.map(lambda a, n: jax.lax.dynamic_update_slice(a, n[:, None].astype(a.dtype), (0, slot, 0, 0)),
                            layer, new)

    def copy(self, layer: jax.Array, src, dst) -> jax.Array:
        """Whole slots `src` copied to `dst` (out-of-range destinations dropped)."""
        return jax.tree.map(lambda a: a.at[:, dst].set(a[:, src], mode="drop"), layer)

    def kernel_layout(self, layer: jax.Array, slot_ids) -> tuple:
        """How a kernel walks rows `slot_ids` of one layer: (tables `[B, pages]`, num_pages,
        page_size, head_stride, page_stride) in elements; a slot is one page of max_len."""
        kv_heads, num_slots, max_len, d = layer.shape
        return slot_ids[:, None], num_slots, max_len, num_slots * max_len * d, max_len * d

    def kernel_view(self, layer_k: jax.Array, layer_v: jax.Array, slot_ids) -> tuple:
        """What the ragged attention kernel reads for rows `slot_ids`: the layer as a pool of
        pages of the kernel's choice (`[kv_heads, slots * max_len / page_size, page_size, hd]`,
        a reshape: no copy), and each row's pages, the consecutive ones of its slot."""
        from pallas_kernels.ragged_paged_attention import slot_page_size

        kv_heads, num_slots, max_len, d = layer_k.shape
        page_size = slot_page_size(max_len, d, layer_k.dtype)
        if page_size is None:
            raise ValueError(f"the attention kernel cannot read a slot cache of max_len {max_len} ({layer_k.dtype})")
        per_slot = max_len // page_size
        pool = lambda layer: jax.tree.map(  # noqa: E731
            lambda a: a.reshape(kv_heads, num_slots * per_slot, page_size, a.shape[-1]), layer)
        tables = slot_ids[:, None] * per_slot + jnp.arange(per_slot, dtype=jnp.int32)[None, :]
        return pool(layer_k), pool(layer_v), tables


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCache:
    """The paged layout: a page pool per layer, `[kv_heads, num_pages, page_size, head_dim]`,
    and a block table mapping each slot's i-th page to a pool page. Pages come from the
    host-side `BlockManager`; table entries past a sequence are ignored."""

    k: tuple  # per layer: [kv_heads, num_pages, page_size, head_dim]
    v: tuple
    block_tables: jax.Array  # [slots, pages_per_seq] int32
    lengths: jax.Array  # [slots] int32
    kv_sharding: object = dataclasses.field(default=None, metadata=dict(static=True))  # as SlotCache's
    head_axis = 0  # of one layer's pool

    @property
    def num_slots(self) -> int:
        return self.block_tables.shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def max_len(self) -> int:
        return self.block_tables.shape[1] * self.page_size

    @classmethod
    def init(cls, config: ModelConfig, num_slots: int, max_len: int, num_pages: int, page_size: int,
             dtype=jnp.float32) -> "PagedCache":
        if max_len % page_size:
            raise ValueError(f"max_len ({max_len}) must be a multiple of page_size ({page_size})")
        shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
        return cls(k=_zeros_per_layer(config.num_layers, shape, dtype),
                   v=_zeros_per_layer(config.num_layers, shape, dtype),
                   block_tables=jnp.zeros((num_slots, max_len // page_size), jnp.int32),
                   lengths=jnp.zeros((num_slots,), jnp.int32))

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, dtype=jnp.float32, scaled: bool | None = None) -> int:
        return SlotCache.bytes_per_slot(config, page_size, dtype, scaled)

    def write(self, cache: jax.Array, slot_ids, starts, num_valid, new: jax.Array) -> jax.Array:
        """Scatter `new[b, :num_valid[b]]` (`[B, T, kv_heads, hd]`) into one layer's pool, at the
        pages holding positions `starts[b] + t` of slot `slot_ids[b]`; padding (and anything past
        `max_len`) goes nowhere."""
        t = new.shape[1]
        ps = self.page_size
        positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        table = self.block_tables[slot_ids]  # [B, pages_per_seq]
        page = jnp.take_along_axis(table, jnp.clip(positions // ps, 0, table.shape[1] - 1), axis=1)
        # Past the table's last page is no room at all (as the slot layout's max_len), not its last page again.
        valid = (jnp.arange(t)[None, :] < num_valid[:, None]) & (positions < self.max_len)
        page = jnp.where(valid, page, self.num_pages)
        page, positions, new = _scatter_rows(page, positions, new, self.num_pages)
        # cache[:, page, offset] with adjacent [B, T] index arrays indexes [kv_heads, B, T, hd]
        return _set(cache, (slice(None), page, positions % ps), new.transpose(2, 0, 1, 3))

    def read(self, cache: jax.Array, slot_ids, kv_len: int, all_slots: bool) -> jax.Array:
        """Gather the first `kv_len` positions of each row's pages from one layer's pool:
        `[B, kv_heads, kv_len, hd]`."""
        del all_slots
        n_pages = -(-kv_len // self.page_size)
        pages = jnp.clip(self.block_tables[slot_ids, :n_pages], 0, self.num_pages - 1)  # [B, n_pages]
        kv_heads, b = cache.shape[0], pages.shape[0]
        # [kv_heads, B, n_pages, ps, hd] -> [B, kv_heads, kv_len, hd]
        return decode(jax.tree.map(lambda a: a[:, pages].reshape(kv_heads, b, n_pages * self.page_size, -1)
                                   [:, :, :kv_len].swapaxes(0, 1), cache))


    paged = True

    def transfer_unit(self, padded: int) -> int:
        del padded
        return self.page_size

    @property
    def no_page(self) -> int:
        return self.num_pages  # out of range: a write there is dropped

    def sequence_out(self, layer: jax.Array, slot, pages, padded: int) -> jax.Array:
        """One layer's first `padded` positions held in `pages`: `[kv_heads, padded, head_dim]`."""
        del slot
        kv_heads, _, page_size, hd = layer.shape
        return jax.tree.map(lambda a: a[:, pages].reshape(kv_heads, pages.shape[0] * page_size, -1)[:, :padded], layer)

    def sequence_in(self, layer: jax.Array, new: jax.Array, slot, pages) -> jax.Array:
        """`new` (`[kv_heads, padded, head_dim]`) written into `pages`; pages out of range drop."""
        del slot
        kv_heads, _, page_size, hd = layer.shape
        return jax.tree.map(lambda a, n: a.at[:, pages].set(n.reshape(kv_heads, pages.shape[0], page_size, -1)
                                                           .astype(a.dtype), mode="drop"), layer, new)

    def copy(self, layer: jax.Array, src, dst) -> jax.Array:
        """Pages `src` copied to `dst` (a fork's copy on write; out-of-range destinations dropped)."""
        return jax.tree.map(lambda a: a.at[:, dst].set(a[:, src], mode="drop"), layer)

    def kernel_layout(self, layer: jax.Array, slot_ids) -> tuple:
        kv_heads, num_pages, page_size, d = layer.shape
        return self.block_tables[slot_ids], num_pages, page_size, num_pages * page_size * d, page_size * d

    def kernel_view(self, layer_k: jax.Array, layer_v: jax.Array, slot_ids) -> tuple:
        """The pools as they are and the rows' block tables."""
        return layer_k, layer_v, self.block_tables[slot_ids]

    def read_block(self, cache: jax.Array, slot_ids, at, size: int) -> jax.Array:
        """Positions `[at, at + size)` of rows `slot_ids` (`at` and `size` multiples of the page
        size, `at` traced): `[B, kv_heads, size, head_dim]`."""
        ps = self.page_size
        pages = jax.lax.dynamic_slice_in_dim(self.block_tables, at // ps, size // ps, axis=1)[slot_ids]
        kv_heads, b = cache.shape[0], pages.shape[0]
        # [kv_heads, B, size / ps, ps, hd] -> [B, kv_heads, size, hd]
        return decode(jax.tree.map(lambda a: a[:, jnp.clip(pages, 0, self.num_pages - 1)]
                                   .reshape(kv_heads, b, size, -1).swapaxes(0, 1), cache))


KVCache = SlotCache | PagedCache


def kv_capacity(config, kv_cache: str, kv_cache_bytes: int, max_seq_len: int, page_size: int, dtype: str,
                num_slots: int, scaled: bool | None = None) -> tuple[int, int | None]:
    """(num_slots, num_pages) that fit `kv_cache_bytes`: the slot layout reserves `max_seq_len`
    per sequence; the paged layout gets as many pages as fit and keeps `num_slots` as its
    limit on concurrent sequences."""
    if kv_cache == "paged":
        num_pages = kv_cache_bytes // PagedCache.bytes_per_page(config, page_size, dtype, scaled)
        if num_pages < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no page of {page_size} tokens")
        return num_slots, int(num_pages)
    slots = kv_cache_bytes // SlotCache.bytes_per_slot(config, max_seq_len, dtype, scaled)
    if slots < 1:
        raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no sequence of max_seq_len={max_seq_len}")
    return int(slots), None
