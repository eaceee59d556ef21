"""Matrices kept in a GGUF file's own quantized blocks (llama.cpp's ggml formats), never as a
float copy: `GGUFWeight` stands where a `[out, in]` matrix of the params pytree stood, each
row the file's bytes for that row (`in / 32` blocks), and is dequantized where it is used.

Block layouts (ggml-common.h), 32 weights each, little-endian:
- Q8_0: f16 d, then 32 int8 q: w = d * q (34 bytes);
- Q4_0: f16 d, then 16 bytes of nibbles: w = d * (q - 8) (18 bytes);
- Q4_1: f16 d, f16 m, then 16 bytes of nibbles: w = d * q + m (20 bytes);
- Q5_0 / Q5_1: as Q4_0 / Q4_1 with a fifth bit per weight (bit i of a 4-byte word, after d
  or d and m): w = d * (q - 16) (22 bytes), w = d * q + m (24 bytes). llama.cpp writes them for
  the matrices whose rows do not divide into 256-weight super-blocks in its k-quant files
  (SmolLM2's 576-wide rows in a Q4_K_M).
A nibble byte j holds weight j in its low half and weight j + 16 in its high half.
The k-quants hold 256 weights a super-block in sub-blocks with their own 6- or 8-bit scales:
- Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128
  nibble bytes: w = d * scale * q - dmin * min (144 bytes);
- Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d: w = d *
  scale * (q - 32) for 16 sub-blocks of 16 (210 bytes).

Here the product is the reference: the blocks widened to f32 on the device and multiplied
(`dense`), which is what XLA runs on any backend; a backend may read the blocks itself
(cbjax/runtime/cpu/kernels.py on a CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# type -> (weights per block, bytes per block)
BLOCK_TYPES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
               "Q4_K": (256, 144), "Q6_K": (256, 210)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GGUFWeight:
    blocks: jax.Array  # [out, in / 32 * block bytes] uint8: each row's blocks as the file holds them
    kind: str = dataclasses.field(metadata=dict(static=True))  # a key of BLOCK_TYPES

    @property
    def shape(self) -> tuple:
        per_block, size = BLOCK_TYPES[self.kind]
        return (self.blocks.shape[0], self.blocks.shape[1] // size * per_block)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_rows(self.blocks, self.kind).astype(dtype)


def check_kind(kind: str, where: str) -> None:
    if kind not in BLOCK_TYPES:
        raise ValueError(f"{where}: GGUF block type {kind} is not one quantization='gguf' reads (it reads "
                         f"{', '.join(BLOCK_TYPES)}); load it with quantization='none' (dequantized to dtype) "
                         "or requantize the file")


def _f16(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Little-endian f16 from its two bytes, as float32."""
    bits = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _nibbles(q: jax.Array) -> jax.Array:
    """`[..., 16]` bytes -> `[..., 32]` values: the low halves (weights 0-15), then the high (16-31)."""
    return jnp.concatenate([q & 0xF, q >> 4], axis=-1).astype(jnp.float32)


def _fifth_bits(b: jax.Array) -> jax.Array:
    """`[..., 4]` bytes, a little-endian word whose bit i is weight i's fifth bit -> `[..., 32]` of 0 or 16."""
    word = b.astype(jnp.uint32)
    word = word[..., 0] | (word[..., 1] << 8) | (word[..., 2] << 16) | (word[..., 3] << 24)
    return (((word[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1) * 16).astype(jnp.float32)


def _q4_k(b: jax.Array) -> jax.Array:
    """`[..., 144]` Q4_K super-blocks -> `[..., 256]` (ggml's dequantize_row_q4_K)."""
    d, dmin = _f16(b[..., 0], b[..., 1])[..., None], _f16(b[..., 2], b[..., 3])[..., None]
    q, packed = b[..., 16:].astype(jnp.int32), b[..., 4:16].astype(jnp.int32)
    low, high = packed[..., :4], packed[..., 4:8]
    # 6-bit scales and mins of sub-blocks 0-3, then 4-7 (their top 2 bits in bytes 0-7's)
    scale = jnp.concatenate([low & 63, (packed[..., 8:] & 0xF) | ((low >> 6) << 4)], axis=-1)
    minimum = jnp.concatenate([high & 63, (packed[..., 8:] >> 4) | ((high >> 6) << 4)], axis=-1)
    chunks = q.reshape(q.shape[:-1] + (4, 32))  # 4 chunks of 32 bytes: sub-blocks 2c (low) and 2c + 1 (high)
    nibbles = jnp.stack([chunks & 0xF, chunks >> 4], axis=-2).reshape(q.shape[:-1] + (8, 32)).astype(jnp.float32)
    return (d * scale.astype(jnp.float32))[..., None] * nibbles - (dmin * minimum.astype(jnp.float32))[..., None]


def _q6_k(b: jax.Array) -> jax.Array:
    """`[..., 210]` Q6_K super-blocks -> `[..., 256]` (ggml's dequantize_row_q6_K)."""
    ql, qh = b[..., :128].astype(jnp.int32), b[..., 128:192].astype(jnp.int32)
    scale = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    d = _f16(b[..., 208], b[..., 209])[..., None]
    halves = []
    for h in range(2):  # each half: 128 weights from 64 low bytes and 32 high bytes
        low, high = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        parts = [(low[..., :32] & 0xF) | ((high & 3) << 4), (low[..., 32:] & 0xF) | (((high >> 2) & 3) << 4),
                 (low[..., :32] >> 4) | (((high >> 4) & 3) << 4), (low[..., 32:] >> 4) | (((high >> 6) & 3) << 4)]
        halves.append(jnp.concatenate(parts, axis=-1) - 32)  # weights 0-127 of the half
    q = jnp.concatenate(halves, axis=-1).astype(jnp.float32).reshape(b.shape[:-1] + (16, 16))
    return (d * scale)[..., None] * q


def dequantize_rows(blocks: jax.Array, kind: str) -> jax.Array:
    """`[..., row bytes]` uint8 rows of `kind` blocks -> `[..., in]` float32."""
    per_block, size = BLOCK_TYPES[kind]
    b = blocks.reshape(blocks.shape[:-1] + (blocks.shape[-1] // size, size))
    if kind in ("Q4_K", "Q6_K"):
        return (_q4_k(b) if kind == "Q4_K" else _q6_k(b)).reshape(blocks.shape[:-1] + (-1,))
    d = _f16(b[..., 0], b[..., 1])[..., None]
    if kind == "Q8_0":
        w = d * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    elif kind == "Q4_0":
        w = d * (_nibbles(b[..., 2:]) - 8.0)
    elif kind == "Q5_0":
        w = d * (_nibbles(b[..., 6:]) + _fifth_bits(b[..., 2:6]) - 16.0)
    elif kind == "Q5_1":
        w = d * (_nibbles(b[..., 8:]) + _fifth_bits(b[..., 4:8])) + _f16(b[..., 2], b[..., 3])[..., None]
    else:  # Q4_1
        w = d * _nibbles(b[..., 4:]) + _f16(b[..., 2], b[..., 3])[..., None]
    return w.reshape(blocks.shape[:-1] + (-1,))


def dense(x: jax.Array, w: GGUFWeight) -> jax.Array:
    """`x @ w.T` in x's dtype, the blocks dequantized to f32 first."""
    return jnp.einsum("...d,od->...o", x.astype(jnp.float32), w.dequantize(jnp.float32)).astype(x.dtype)


def embedding_rows(embed: GGUFWeight, tokens: jax.Array, dtype) -> jax.Array:
    return dequantize_rows(embed.blocks[tokens], embed.kind).astype(dtype)
