"""Ragged paged attention as a Pallas kernel for the Triton lowering (GPU; interpret mode on CPU).

Grid `(sequences, kv_heads, query tiles)`: program (s, h, i) takes query rows
`[cu_q_lens[s] + i * block_q, ...)` of sequence s (up to `block_q` of them, with every
query head of KV head h: GQA groups share each page they load) and walks the pages
the tile can see, `pages_per_block` at a time, with an online softmax: from the first
page inside the tile's sliding window (the first page, without one) to the page of its
last query. A decode row is a tile of one query; a prefill chunk of 40 tokens is three
tiles of 16 that each read the pages once, instead of 40 single-query reads. Programs
whose tile starts past their sequence's rows do nothing (the grid is sized for the worst
case, one sequence holding every row). The normalized tile is stored with a row mask,
straight into the flat output.

Split-KV (flash-decoding), `kv_splits` > 1: one program per (sequence, KV head) leaves a
single long sequence on a few of the GPU's multiprocessors (8 of an H200's 132 for Llama-3's
KV heads). The third grid axis then counts (tile, split): split j walks the j-th of
`kv_splits` equal spans of the tile's key blocks and stores its unnormalized output with its
running max and sum (f32), and a log-sum-exp combine outside the kernel merges the spans. A
tile with fewer blocks than splits leaves the rest empty (max -inf, sum 0: no weight), so a
prefill chunk in the same call costs only its partials' bytes.

Triton's tensors have power-of-two sizes. A head_dim that is not one (80, 96, 112, ...)
is padded to the next: the queries with zeros in the wrapper, and the pages are read
through a flat view of the pool with the padded columns masked to zeros, so the cache
keeps its own head_dim and the padding costs no memory traffic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Pallas' Triton module is imported where a kernel is built, not here: its MLIR dialect
# is slow to import, which every process importing cbjax paid (a server's start, a script's --help).

_MIN_DOT = 16  # Triton's dot wants every dimension >= 16
_MASKED = -1e30  # finite: a row that sees nothing in a block stays finite (and is discarded)


def padded_head_dim(head_dim: int) -> int:
    """The head_dim the kernel computes with: the next power of two, at least 16."""
    return max(pl.next_power_of_2(head_dim), _MIN_DOT)


def _load_pages(ref, pages, *, page_size: int, head_dim: int, padded_dim: int):
    """The keys (or values) of `pages` as `[pages * page_size, padded_dim]`, in the cache's
    dtype (bf16 dots on tensor cores). `ref` is one head's pool: `[num_pages, page_size,
    head_dim]`, or flat `[num_pages * page_size * head_dim]` when head_dim is padded."""
    from jax.experimental.pallas import triton as plgpu

    tokens = pages.shape[0] * page_size
    if padded_dim == head_dim:
        return ref[pages].reshape(tokens, head_dim)
    row = (pages[:, None] * page_size + jnp.arange(page_size)[None, :]).reshape(tokens)
    column = jnp.arange(padded_dim)
    index = row[:, None] * head_dim + jnp.minimum(column, head_dim - 1)[None, :]
    return plgpu.load(ref.at[index], mask=jnp.broadcast_to(column[None, :] < head_dim, index.shape), other=0)


def _kernel(q_ref, k_ref, v_ref, kv_len_ref, q_start_ref, q_end_ref, table_ref, *refs, scale, block_q,
            pages_per_block, page_size, num_pages, head_dim, window, kv_splits):
    from jax.experimental.pallas import triton as plgpu

    # 8-bit K/V come with a scale per key (`[num_pages, page_size]` each): q.k scaled per key
    # after the dot, and each probability times its value's scale before p.v, so the 8-bit
    # pages are widened but never multiplied through.
    if kv_splits > 1:
        *scale_refs, o_ref, m_ref, l_ref = refs
    else:
        *scale_refs, o_ref = refs
    tile, split = pl.program_id(2) // kv_splits, pl.program_id(2) % kv_splits
    _, block_g, padded_dim = q_ref.shape
    block_tokens = pages_per_block * page_size
    seq_start, seq_end, kv_len = q_start_ref[0], q_end_ref[0], kv_len_ref[0]
    row0 = seq_start + tile * block_q
    load = functools.partial(_load_pages, page_size=page_size, head_dim=head_dim, padded_dim=padded_dim)

    @pl.when(row0 < seq_end)
    def _():
        rows = row0 + jnp.arange(block_q)
        position = kv_len - (seq_end - seq_start) + (rows - seq_start)  # [block_q]
        q = q_ref[pl.ds(row0, block_q)]  # [block_q, block_g, padded_dim]
        q = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(block_q * block_g, padded_dim)
        row_position = jnp.repeat(position, block_g)  # the row of q above, for each of its heads
        first_position = kv_len - (seq_end - seq_start) + (row0 - seq_start)
        last = jnp.minimum(jnp.minimum(row0 + block_q, seq_end) - 1 - seq_start + kv_len - (seq_end - seq_start),
                           kv_len - 1)

        def body(j, carry):
            o, m, l = carry
            pages = table_ref[pl.ds(j * pages_per_block, pages_per_block)]
            pages = jnp.clip(pages, 0, num_pages - 1)  # entries past the sequence may be anything
            k, v = load(k_ref, pages), load(v_ref, pages)
            if scale_refs:
                k_scale, v_scale = (r[pages].reshape(block_tokens) for r in scale_refs)
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [block_q * block_g, block_tokens]
            if scale_refs:
                logits = logits * k_scale[None, :]
            key = j * block_tokens + jnp.arange(block_tokens)
            seen = key[None, :] <= row_position[:, None]
            if window:
                seen &= key[None, :] > row_position[:, None] - window
            logits = jnp.where(seen, logits, _MASKED)
            m_new = jnp.maximum(m, logits.max(axis=-1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(logits - m_new[:, None])
            weights = p * v_scale[None, :] if scale_refs else p
            pv = jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return correction[:, None] * o + pv, m_new, correction * l + p.sum(axis=-1)

        # A sliding window skips the blocks before the first key the tile's first query sees.
        start = jnp.maximum(first_position - window + 1, 0) // block_tokens if window else 0
        steps = pl.cdiv(last + 1, block_tokens)
        if kv_splits > 1:  # this program's span of the tile's blocks
            span = pl.cdiv(steps - start, kv_splits)
            start = start + split * span
            steps = jnp.minimum(start + span, steps)
        init = (jnp.zeros((block_q * block_g, padded_dim), jnp.float32),
                jnp.full((block_q * block_g,), _MASKED, jnp.float32), jnp.zeros((block_q * block_g,), jnp.float32))
        o, m, l = jax.lax.fori_loop(start, steps, body, init)
        row_mask = (rows < seq_end)[:, None]
        if kv_splits > 1:  # unnormalized, with the max and sum the combine weighs it by
            plgpu.store(m_ref.at[pl.ds(row0, block_q)], m.reshape(block_q, block_g),
                        mask=jnp.broadcast_to(row_mask, (block_q, block_g)))
            plgpu.store(l_ref.at[pl.ds(row0, block_q)], l.reshape(block_q, block_g),
                        mask=jnp.broadcast_to(row_mask, (block_q, block_g)))
            out = o.reshape(block_q, block_g, padded_dim)
        else:
            out = (o / jnp.where(l > 0, l, 1.0)[:, None]).reshape(block_q, block_g, padded_dim)
        mask = jnp.broadcast_to(row_mask[:, :, None], out.shape)
        plgpu.store(o_ref.at[pl.ds(row0, block_q)], out.astype(o_ref.dtype), mask=mask)


def attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, scale, block_q, pages_per_block,
              interpret, window=0, num_warps=None, num_stages=None, kv_splits=1):
    """`[T, q_heads, hd]` in q's dtype (see `reference` for the contract). `k_pages` and
    `v_pages` may be 8-bit with their scales (`kv_cache.QuantizedKV`-like: values and scale).
    `kv_splits`: programs sharing each query tile's keys (split-KV, above)."""
    from jax.experimental.pallas import triton as plgpu

    scales = ()
    if hasattr(k_pages, "scale"):
        scales = tuple(p.scale.reshape(p.scale.shape[:3]) for p in (k_pages, v_pages))
        k_pages, v_pages = k_pages.values, v_pages.values
    num_tokens, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = page_indices.shape
    group = q_heads // kv_heads
    block_g = pl.next_power_of_2(group)
    block_q = max(block_q, pl.cdiv(_MIN_DOT, block_g))
    padded_dim = padded_head_dim(head_dim)
    tiles = pl.cdiv(num_tokens, block_q)
    padded_pages = pl.cdiv(pages_per_seq, pages_per_block) * pages_per_block
    # Pad so that every tile read and page-block read stays in bounds (the padding is masked).
    table = jnp.pad(page_indices, ((0, 0), (0, padded_pages - pages_per_seq)))
    qg = jnp.pad(q.reshape(num_tokens, kv_heads, group, head_dim),
                 ((0, block_q), (0, 0), (0, block_g - group), (0, padded_dim - head_dim)))
    rows = num_tokens + block_q
    if padded_dim == head_dim:
        pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h, i: (h, 0, 0, 0))
    else:  # read through a flat view (a reshape of a contiguous array: no copy)
        k_pages, v_pages = (p.reshape(kv_heads, -1) for p in (k_pages, v_pages))
        pool_spec = pl.BlockSpec((None, k_pages.shape[1]), lambda s, h, i: (h, 0))
    kernel = functools.partial(_kernel, scale=scale, block_q=block_q, pages_per_block=pages_per_block,
                               page_size=page_size, num_pages=num_pages, head_dim=head_dim, window=window,
                               kv_splits=kv_splits)
    if kv_splits > 1:  # per split: the unnormalized output, its running max and sum
        out_shape = [jax.ShapeDtypeStruct((kv_splits, rows, kv_heads, block_g, padded_dim), jnp.float32),
                     *[jax.ShapeDtypeStruct((kv_splits, rows, kv_heads, block_g), jnp.float32)] * 2]
        out_specs = [pl.BlockSpec((None, rows, None, block_g, padded_dim), lambda s, h, i: (i % kv_splits, 0, h, 0, 0)),
                     *[pl.BlockSpec((None, rows, None, block_g), lambda s, h, i: (i % kv_splits, 0, h, 0))] * 2]
    else:
        out_shape = jax.ShapeDtypeStruct((rows, kv_heads, block_g, padded_dim), q.dtype)
        out_specs = pl.BlockSpec((rows, None, block_g, padded_dim), lambda s, h, i: (0, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_seqs, kv_heads, tiles * kv_splits),
        in_specs=[
            pl.BlockSpec((rows, None, block_g, padded_dim), lambda s, h, i: (0, h, 0, 0)),
            pool_spec,
            pool_spec,
            pl.BlockSpec((1,), lambda s, h, i: (s,)),
            pl.BlockSpec((1,), lambda s, h, i: (s,)),
            pl.BlockSpec((1,), lambda s, h, i: (s,)),
            pl.BlockSpec((None, padded_pages), lambda s, h, i: (s, 0)),
            *[pl.BlockSpec((None, num_pages, page_size), lambda s, h, i: (h, 0, 0))] * len(scales),
        ],
        out_specs=out_specs,
        # Triton named explicitly: JAX 0.10's default GPU lowering is Mosaic GPU, which this
        # kernel (gathers of whole pages, masked stores) is not written for.
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or (4 if padded_dim <= 64 else 8),
                                             num_stages=num_stages or 2),
        interpret=interpret,
        name="cbjax_ragged_paged_attention",
    )(qg, k_pages, v_pages, kv_lens, cu_q_lens[:-1], cu_q_lens[1:], table, *scales)
    if kv_splits > 1:
        out = combine_splits(*out).astype(q.dtype)
    return out[:num_tokens, :, :group, :head_dim].reshape(num_tokens, q_heads, head_dim)


def combine_splits(o, m, l):
    """The normalized output of split-KV partials (`o [splits, ..., d]` unnormalized, `m`, `l`
    `[splits, ...]` their running max and sum): each split weighed by exp(its max - the max)."""
    top = m.max(axis=0)
    weight = jnp.exp(m - top[None])
    total = (weight * l).sum(axis=0)
    out = (weight[..., None] * o).sum(axis=0)
    return out / jnp.where(total > 0, total, 1.0)[..., None]
