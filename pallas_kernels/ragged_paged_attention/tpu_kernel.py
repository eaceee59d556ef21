"""Ragged paged attention as a Pallas kernel for Mosaic TPU (TPU interpret mode on CPU).

Grid `(kv_heads, query blocks)`. The flat token buffer is cut into blocks of `block_q`
tokens at fixed offsets, so each program owns its output block outright (BlockSpec
writes, no masked or overlapping stores, which Mosaic does not have). A block may hold
the tail of one sequence, several whole decode rows and the head of another chunk:
the program walks the sequences that overlap it (their range is prefetched with the
lengths and page tables into SMEM) and, for each, the pages its last token in the block
can see (from the first inside the sliding window of its first token in the block, with
one), `pages_per_block` pages per DMA step, double buffered: the next step's pages
are copied from HBM while this step's are in the MXU. Rows of the block that belong to
another sequence are masked out of that sequence's pass; an online softmax over the
passes leaves each row with its own sequence's attention.

The query rows are laid out `[kv_heads, tokens * group, head_dim]` (GQA: the query
heads of one KV head are consecutive rows), so one dot serves every head of the group.
Operands stay in their dtype (bf16 on the MXU); the dots accumulate in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Pallas' TPU module is imported where a kernel is built, not here: its MLIR dialect
# is slow to import, which every process importing cbjax paid (a server's start, a script's --help).

_MASKED = -1e30


def _kernel(kv_lens_ref, table_ref, cu_ref, first_ref, last_ref,  # scalar prefetch (SMEM)
            q_ref, k_hbm, v_hbm,  # inputs: q block in VMEM, pages in HBM
            o_ref,  # output block
            k_buf, v_buf, sems,  # scratch
            *, scale, block_q, group, page_size, pages_per_block, table_width, window):
    from jax.experimental.pallas import tpu as pltpu

    head, block = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    block_tokens = pages_per_block * page_size
    row0 = block * block_q
    # The token each row of the block belongs to (rows are token-major, `group` heads each):
    # (r + 0.5) / group in float32 is exact enough to floor for any buffer that fits in memory.
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0).astype(jnp.float32)
    token = row0 + ((row + 0.5) * (1.0 / group)).astype(jnp.int32)  # [rows, 1]
    q = (q_ref[...].astype(jnp.float32) * scale).astype(q_ref.dtype)

    def copies(seq, step, slot):
        out = []
        for p in range(pages_per_block):
            page = table_ref[seq * table_width + step * pages_per_block + p]
            rows_at = pl.ds(p * page_size, page_size)
            out.append(pltpu.make_async_copy(k_hbm.at[head, page], k_buf.at[slot, rows_at], sems.at[slot, 0]))
            out.append(pltpu.make_async_copy(v_hbm.at[head, page], v_buf.at[slot, rows_at], sems.at[slot, 1]))
        return out

    def one_sequence(seq, carry):
        q_lo, q_hi, kv_len = cu_ref[seq], cu_ref[seq + 1], kv_lens_ref[seq]
        lo, hi = jnp.maximum(q_lo, row0), jnp.minimum(q_hi, row0 + block_q)
        # Keys the sequence's last token in this block sees; none when it has no token here.
        needed = jnp.where(hi > lo, kv_len - (q_hi - hi), 0)
        steps = jax.lax.div(needed + block_tokens - 1, block_tokens)  # lax: jnp's floor division lowers via sign
        # A sliding window skips the steps before the first key its first token here sees.
        start = jnp.int32(0)
        if window:
            first_key = jnp.maximum(kv_len - (q_hi - lo) - window + 1, 0)
            start = jnp.minimum(jax.lax.div(first_key, block_tokens), steps)
        mine = (token >= q_lo) & (token < q_hi)  # [rows, 1]
        position = kv_len - (q_hi - q_lo) + (token - q_lo)  # [rows, 1]

        @pl.when(steps > start)
        def _():
            for c in copies(seq, start, jax.lax.rem(start, 2)):
                c.start()

        def one_step(step, carry):
            acc, m, l = carry
            slot = jax.lax.rem(step, 2)

            @pl.when(step + 1 < steps)
            def _():
                for c in copies(seq, step + 1, 1 - slot):
                    c.start()

            for c in copies(seq, step, slot):
                c.wait()
            k = k_buf[slot]  # [block_tokens, head_dim]
            v = v_buf[slot]
            logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            key = step * block_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
            seen = mine & (key <= position)  # [rows, block_tokens]
            if window:
                seen &= key > position - window
            logits = jnp.where(seen, logits, _MASKED)
            m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
            p = jnp.where(seen, jnp.exp(logits - m_new), 0.0)
            correction = jnp.exp(m - m_new)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return acc * correction + pv, m_new, l * correction + jnp.sum(p, axis=1, keepdims=True)

        return jax.lax.fori_loop(start, steps, one_step, carry)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), _MASKED, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    acc, _, l = jax.lax.fori_loop(first_ref[block], last_ref[block] + 1, one_sequence, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, scale, block_q, pages_per_block,
              interpret=False, window=0):
    """`[T, q_heads, hd]` in q's dtype (see `reference` for the contract); `interpret`: run on
    the CPU under Pallas's TPU interpreter (DMAs and semaphores simulated)."""
    from jax.experimental.pallas import tpu as pltpu

    num_tokens, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = page_indices.shape
    group = q_heads // kv_heads
    blocks = pl.cdiv(num_tokens, block_q)
    padded_tokens = blocks * block_q
    width = pl.cdiv(pages_per_seq, pages_per_block) * pages_per_block
    # Table entries past a sequence's pages may be anything: clip them to a real page.
    table = jnp.clip(jnp.pad(page_indices, ((0, 0), (0, width - pages_per_seq))), 0, num_pages - 1).reshape(-1)
    total = cu_q_lens[-1]
    starts = jnp.arange(blocks, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(cu_q_lens, starts, side="right").astype(jnp.int32) - 1
    last = jnp.searchsorted(cu_q_lens, jnp.minimum(starts + block_q, total) - 1, side="right").astype(jnp.int32) - 1
    first = jnp.clip(first, 0, num_seqs - 1)
    last = jnp.where(starts < total, jnp.clip(last, 0, num_seqs - 1), first - 1)  # a block of padding: none
    rows = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    rows = rows.reshape(padded_tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    rows = rows.reshape(kv_heads, padded_tokens * group, head_dim)
    block_rows = block_q * group
    kernel = functools.partial(_kernel, scale=scale, block_q=block_q, group=group, page_size=page_size,
                               pages_per_block=pages_per_block, table_width=width, window=window)
    q_spec = pl.BlockSpec((None, block_rows, head_dim), lambda h, b, *_: (h, b, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(kv_heads, blocks),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((2, pages_per_block * page_size, head_dim), k_pages.dtype),
                            pltpu.VMEM((2, pages_per_block * page_size, head_dim), v_pages.dtype),
                            pltpu.SemaphoreType.DMA((2, 2))],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="cbjax_ragged_paged_attention_tpu",
    )(kv_lens, table, cu_q_lens, first, last, rows, k_pages, v_pages)
    out = out.reshape(kv_heads, padded_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded_tokens, q_heads, head_dim)[:num_tokens]
