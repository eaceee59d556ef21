"""Paged decode attention as a Pallas kernel for the Triton lowering (GPU; interpret mode on CPU).

Grid `(slots, kv_heads, splits)`: one program takes every query head of one KV head
(GQA: the group shares each K/V page it loads) over one split of the sequence's
pages, so even a single long sequence spreads over `splits` programs
(flash-decoding). Each program walks its pages `pages_per_block` at a time with an
online softmax and writes an unnormalized partial (o, running max m, running sum l);
`combine` merges the splits with a log-sum-exp. Everything Triton-specific stays in
this file, so a Mosaic GPU version can stand beside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_MIN_DOT = 16  # Triton's dot wants every dimension >= 16


def _kernel(q_ref, k_ref, v_ref, table_ref, length_ref, o_ref, m_ref, l_ref, *, scale, pages_per_block,
            pages_per_split):
    split = pl.program_id(2)
    block_g, head_dim = q_ref.shape
    num_pages, page_size = k_ref.shape[0], k_ref.shape[1]
    block_tokens = pages_per_block * page_size
    length = length_ref[0]
    first_page = split * pages_per_split
    end_page = jnp.minimum(pl.cdiv(length, page_size), first_page + pages_per_split)
    q = q_ref[...].astype(jnp.float32) * scale

    def body(i, carry):
        o, m, l = carry
        start_page = first_page + i * pages_per_block
        pages = table_ref[pl.ds(start_page, pages_per_block)]
        pages = jnp.clip(pages, 0, num_pages - 1)  # entries past the sequence may be anything
        k = k_ref[pages].reshape(block_tokens, head_dim).astype(jnp.float32)
        v = v_ref[pages].reshape(block_tokens, head_dim).astype(jnp.float32)
        logits = jnp.dot(q, k.T)  # [block_g, block_tokens]
        token = start_page * page_size + jnp.arange(block_tokens)
        logits = jnp.where((token < length)[None, :], logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        return correction[:, None] * o + jnp.dot(p, v), m_new, correction * l + p.sum(axis=-1)

    steps = jnp.maximum(pl.cdiv(end_page - first_page, pages_per_block), 0)
    init = (jnp.zeros((block_g, head_dim), jnp.float32), jnp.full((block_g,), -jnp.inf, jnp.float32),
            jnp.zeros((block_g,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, steps, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def partials(q, k_pages, v_pages, block_tables, lengths, *, scale, pages_per_block, splits, interpret):
    """Per-split unnormalized outputs: o `[slots, kv_heads, splits, block_g, hd]`, m and l
    `[slots, kv_heads, splits, block_g]` (block_g = the query-head group, padded for dot)."""
    slots, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    group = q_heads // kv_heads
    block_g = max(_MIN_DOT, pl.next_power_of_2(group))
    pages_per_split = pl.cdiv(pl.cdiv(pages_per_seq, splits), pages_per_block) * pages_per_block
    padded_pages = pages_per_split * splits
    # Pad the table so every block read stays in bounds (the padding is masked by length).
    table = jnp.pad(block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))
    qg = jnp.pad(q.reshape(slots, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, block_g - group), (0, 0)))

    kernel = functools.partial(_kernel, scale=scale, pages_per_block=pages_per_block,
                               pages_per_split=pages_per_split)
    out_shape = (jax.ShapeDtypeStruct((slots, kv_heads, splits, block_g, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((slots, kv_heads, splits, block_g), jnp.float32),
                 jax.ShapeDtypeStruct((slots, kv_heads, splits, block_g), jnp.float32))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(slots, kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, None, block_g, head_dim), lambda s, h, p: (s, h, 0, 0)),
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h, p: (h, 0, 0, 0)),
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h, p: (h, 0, 0, 0)),
            pl.BlockSpec((None, padded_pages), lambda s, h, p: (s, 0)),
            pl.BlockSpec((1,), lambda s, h, p: (s,)),
        ],
        out_specs=(
            pl.BlockSpec((None, None, None, block_g, head_dim), lambda s, h, p: (s, h, p, 0, 0)),
            pl.BlockSpec((None, None, None, block_g), lambda s, h, p: (s, h, p, 0)),
            pl.BlockSpec((None, None, None, block_g), lambda s, h, p: (s, h, p, 0)),
        ),
        interpret=interpret,
        name="cbjax_paged_decode_attention",
    )(qg, k_pages, v_pages, table, lengths)
