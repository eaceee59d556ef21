"""Ragged paged attention on Mosaic GPU, Pallas' Hopper backend (TMA copies, wgmma on the tensor
cores): the backend JAX keeps, where the Triton one (triton_kernel.py) is deprecated. The
contract of `reference`; a tuning candidate beside the Triton kernel (kernel.py), never the default.

Grid `(work items, KV heads, kv_splits)`. A work item is a tile of up to 8 tokens of one
sequence (a list made in XLA from `cu_q_lens`, `_work_items`), each token's query heads of KV
head h padded to 8 rows, in a 64-row tile (wgmma's M); in a decode call (`cu_q_lens` None: one
row a sequence) a tile is one token, an item a sequence. Split j of a tile walks the j-th of
`kv_splits` equal spans of the key blocks the tile sees. A block is `pages_per_block` pages,
each brought in by one TMA copy at the page the table names, into one of `stages`
shared-memory buffers: the next `stages - 1` blocks' copies are in flight while a block is
computed. Per block, `q @ k.T` (one wgmma, K read transposed in shared memory), the causal and
window mask by row, an online softmax in registers, the probabilities through shared memory in
the KV's dtype, and `p @ v` (a second wgmma). Each program stores every token's rows on their
own (a tile never spills into the next sequence's rows) as an unnormalized f32 output with its
running max and sum, and the log-sum-exp combine outside the kernel
(triton_kernel.combine_splits) normalizes and merges the splits.

Not here (the Triton kernel keeps them): 8-bit KV with its scales, f32 KV, head_dim other than
64/128/192/256 and blocks of fewer than 64 keys (layout inference refuses those tiles at JAX 0.10
and 0.11). Its interpret-mode check needs JAX >= 0.11: earlier GPU interpreters do not read a
transposed wgmma operand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu import interpret_params, swizzled
from pallas_kernels.ragged_paged_attention.triton_kernel import combine_splits

# Pallas' Mosaic GPU module is imported where a kernel is built, not here (slow to import).
TILE_ROWS = 64  # wgmma's M: the query heads of one KV head, padded
GROUP_ROWS = 8  # the padded group a program loads and stores (one 8-row tile of shared memory)
DTYPES = (jnp.bfloat16, jnp.float16)
SHARED_MEMORY_BYTES = 232_448  # an H100's or H200's per block (227 KB)
_MASKED = -1e30


def interpretable() -> bool:
    """Whether this JAX's GPU interpreter runs the kernel: from 0.11 it reads a transposed wgmma
    operand (`q @ k.T`); 0.10's stops there."""
    return jax.__version_info__ >= (0, 11)


def unsupported(*, q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype, pages_per_block: int,
                stages: int) -> str | None:
    """Why this kernel does not take the call, or None (the tuner leaves such launches out)."""
    if np.dtype(dtype) not in [np.dtype(d) for d in DTYPES]:
        return f"Mosaic GPU form: KV is {np.dtype(dtype).name}, it takes bf16 or f16 (8-bit stays with Triton)"
    if q_heads // kv_heads > TILE_ROWS:
        return f"Mosaic GPU form: a group of {q_heads // kv_heads} query heads > {TILE_ROWS}"
    # Narrower tiles fail Mosaic GPU's layout inference at JAX 0.10 and 0.11 (head_dim 16-96, 16 or
    # 32 keys a block): those stay with the Triton kernel.
    if head_dim % 64 or head_dim > 256:
        return f"Mosaic GPU form: head_dim {head_dim} (it takes 64, 128, 192 or 256)"
    block_kv = pages_per_block * page_size
    if block_kv % 64 or block_kv > 256:
        return (f"Mosaic GPU form: {pages_per_block} pages of {page_size} keys a block ({block_kv}); "
                f"it takes 64, 128, 192 or 256")
    if stages < 1:
        return f"Mosaic GPU form: stages must be >= 1, got {stages}"
    if (need := shared_memory_bytes(head_dim, block_kv, stages)) > SHARED_MEMORY_BYTES:
        return f"Mosaic GPU form: {need} bytes of shared memory > {SHARED_MEMORY_BYTES} (Hopper's)"
    return None


def shared_memory_bytes(head_dim: int, block_kv: int, stages: int) -> int:
    """What a program holds in shared memory (16-bit q, K, V and probabilities, f32 output and
    statistics), plus 4 KB for barriers and alignment."""
    return (TILE_ROWS * head_dim * 2 + 2 * stages * block_kv * head_dim * 2 + TILE_ROWS * block_kv * 2
            + TILE_ROWS * head_dim * 4 + 2 * TILE_ROWS * 4 + 4096)


def _transposed(ref):
    """`ref` read as its transpose (wgmma's B side of `q @ k.T`), in this JAX's spelling."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return ref.transpose((1, 0)) if hasattr(ref, "transpose") else plgpu.transpose_ref(ref, (1, 0))


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "kv_splits", "stages", "window",
                                             "interpret"))
def attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens=None, *, scale, pages_per_block, kv_splits=1,
              stages=2, window=0, interpret=False):
    """`[T, q_heads, hd]` in q's dtype, the contract of `reference`; `cu_q_lens` None: one query
    row a sequence (a decode call: a tile is then one token)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_tokens, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs = kv_lens.shape[0]
    why = unsupported(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                      dtype=k_pages.dtype, pages_per_block=pages_per_block, stages=stages)
    if why:
        raise ValueError(why)
    decode = cu_q_lens is None
    if decode:
        if num_tokens != num_seqs:
            raise ValueError(f"a decode call (cu_q_lens None) has one row a sequence: {num_tokens} rows, {num_seqs}")
        cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    group = q_heads // kv_heads
    rows = -(-group // GROUP_ROWS) * GROUP_ROWS  # a token's rows in the tile
    tokens = 1 if decode else TILE_ROWS // rows  # a tile's tokens
    block_kv = pages_per_block * page_size
    table = jnp.pad(page_indices, ((0, 0), (0, -page_indices.shape[1] % pages_per_block)))
    dtype = k_pages.dtype
    qg = (q.astype(jnp.float32) * scale).astype(dtype).reshape(num_tokens, kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, tokens), (0, 0), (0, rows - group), (0, 0)))  # a tile past the end reads padding

    if decode:
        item_seq, item_tile = jnp.arange(num_seqs, dtype=jnp.int32), jnp.zeros((num_seqs,), jnp.int32)
    else:
        item_seq, item_tile = _work_items(cu_q_lens, num_tokens, tokens)

    def body(q_gmem, k_gmem, v_gmem, lens_gmem, cu_gmem, table_gmem, seq_gmem, tile_gmem, o_gmem, m_gmem, l_gmem,
             q_smem, k_smem, v_smem, p_smem, o_smem, m_smem, l_smem, q_barrier, kv_barriers):
        item, h, split = lax.axis_index("item"), lax.axis_index("h"), lax.axis_index("split")
        s, tile = seq_gmem[item], tile_gmem[item]
        seq_start, seq_end, kv_len = cu_gmem[s], cu_gmem[s + 1], lens_gmem[s]
        token0 = seq_start + tile * tokens

        @pl.when(token0 < seq_end)
        def _():
            first_position = kv_len - (seq_end - seq_start) + (token0 - seq_start)
            last_position = jnp.minimum(first_position + tokens - 1, kv_len - 1)
            if tokens * rows < TILE_ROWS:
                q_smem[...] = jnp.zeros((TILE_ROWS, head_dim), dtype)  # the rows no token fills
                plgpu.commit_smem()
            for i in range(tokens):  # the tokens past the sequence's end are read, never stored
                plgpu.copy_gmem_to_smem(q_gmem.at[token0 + i, h], q_smem.at[pl.ds(i * rows, rows)], q_barrier)
            # A sliding window skips the blocks before the first key the tile's first row sees.
            first = jnp.maximum(first_position - window + 1, 0) // block_kv if window else 0
            last = pl.cdiv(last_position + 1, block_kv)
            span = pl.cdiv(last - first, kv_splits)
            lo = first + split * span
            hi = jnp.minimum(lo + span, last)

            def fetch(block, slot):
                for i in range(pages_per_block):
                    page = jnp.clip(table_gmem[s, block * pages_per_block + i], 0, num_pages - 1)
                    keys = pl.ds(i * page_size, page_size)
                    plgpu.copy_gmem_to_smem(k_gmem.at[h, page], k_smem.at[slot, keys], kv_barriers.at[slot])
                    plgpu.copy_gmem_to_smem(v_gmem.at[h, page], v_smem.at[slot, keys], kv_barriers.at[slot])

            for ahead in range(stages - 1):  # the first blocks' copies, before any compute
                pl.when(lo + ahead < hi)(lambda ahead=ahead: fetch(lo + ahead, ahead))
            plgpu.barrier_wait(q_barrier)

            def step(block, carry):
                o, m, l = carry
                nxt = block + stages - 1  # into the buffer the block before this one used
                pl.when(nxt < hi)(lambda: fetch(nxt, lax.rem(nxt - lo, stages)))
                slot = lax.rem(block - lo, stages)
                plgpu.barrier_wait(kv_barriers.at[slot])

                def scores(acc):
                    plgpu.wgmma(acc, q_smem, _transposed(k_smem.at[slot]))
                    plgpu.wgmma_wait(0)
                    return acc[...]

                logits = pl.run_scoped(scores, plgpu.ACC((TILE_ROWS, block_kv), jnp.float32))
                key = block * block_kv + lax.broadcasted_iota(jnp.int32, (TILE_ROWS, block_kv), 1)
                position = first_position + lax.broadcasted_iota(jnp.int32, (TILE_ROWS, block_kv), 0) // rows
                seen = key <= position
                if window:
                    seen = seen & (key > position - window)
                logits = jnp.where(seen, logits, _MASKED)
                m_new = jnp.maximum(m, logits.max(axis=1))
                correction = jnp.exp(m - m_new)
                p = jnp.exp(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
                p_smem[...] = p.astype(dtype)
                plgpu.commit_smem()

                def values(acc):
                    plgpu.wgmma(acc, p_smem, v_smem.at[slot])
                    plgpu.wgmma_wait(0)
                    return acc[...]

                pv = pl.run_scoped(values, plgpu.ACC((TILE_ROWS, head_dim), jnp.float32))
                o = o * lax.broadcast_in_dim(correction, o.shape, [0]) + pv
                return o, m_new, correction * l + p.sum(axis=1)

            init = (jnp.zeros((TILE_ROWS, head_dim), jnp.float32), jnp.full((TILE_ROWS,), _MASKED, jnp.float32),
                    jnp.zeros((TILE_ROWS,), jnp.float32))
            o, m, l = lax.fori_loop(lo, hi, step, init)
            o_smem[...] = o
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            for i in range(tokens):  # each token of the sequence its own rows: no tile spills into the next
                @pl.when(token0 + i < seq_end)
                def _():
                    ours = pl.ds(i * rows, rows)
                    plgpu.copy_smem_to_gmem(o_smem.at[ours], o_gmem.at[split, token0 + i, h])
                    plgpu.copy_smem_to_gmem(m_smem.at[ours], m_gmem.at[split, token0 + i, h])
                    plgpu.copy_smem_to_gmem(l_smem.at[ours], l_gmem.at[split, token0 + i, h])
            plgpu.wait_smem_to_gmem(0)

    stats = jax.ShapeDtypeStruct((kv_splits, num_tokens, kv_heads, rows), jnp.float32)
    o, m, l = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((kv_splits, num_tokens, kv_heads, rows, head_dim), jnp.float32), stats, stats),
        grid=(item_seq.shape[0], kv_heads, kv_splits),
        grid_names=("item", "h", "split"),
        scratch_types=dict(
            q_smem=plgpu.SMEM((TILE_ROWS, head_dim), dtype, transforms=swizzled(dtype, head_dim, "lhs")),
            k_smem=plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=swizzled(dtype, head_dim, "rhs")),
            v_smem=plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=swizzled(dtype, head_dim, "rhs")),
            p_smem=plgpu.SMEM((TILE_ROWS, block_kv), dtype, transforms=swizzled(dtype, block_kv, "lhs")),
            o_smem=plgpu.SMEM((TILE_ROWS, head_dim), jnp.float32),
            m_smem=plgpu.SMEM((TILE_ROWS,), jnp.float32),
            l_smem=plgpu.SMEM((TILE_ROWS,), jnp.float32),
            q_barrier=plgpu.Barrier(num_arrivals=tokens),
            kv_barriers=plgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=stages)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params() if interpret else None,
    )(qg, k_pages, v_pages, kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32), table.astype(jnp.int32),
      item_seq, item_tile)
    # Rows past the last sequence's tokens are never stored: whatever they hold, they are dropped.
    valid = (jnp.arange(num_tokens) < cu_q_lens[-1])[None, :, None, None]
    o, m, l = jnp.where(valid[..., None], o, 0.0), jnp.where(valid, m, _MASKED), jnp.where(valid, l, 0.0)
    out = combine_splits(o, m, l)[:, :, :group]
    return out.reshape(num_tokens, q_heads, head_dim).astype(q.dtype)


def _work_items(cu_q_lens, num_tokens: int, tokens: int) -> tuple:
    """The grid's first axis as a list of (sequence, tile) items, the tiles that hold tokens: a
    sequence of q tokens has ceil(q / tokens) of them, so there are at most S + T / tokens items
    (a grid of sequences x the tiles of the longest possible one would be S x T / tokens, nearly
    all of it programs that exit at once in a batch of decodes). Items past the last are given a
    tile past their sequence's end, so they exit."""
    num_seqs = cu_q_lens.shape[0] - 1
    items = num_seqs + num_tokens // tokens
    tiles = (cu_q_lens[1:] - cu_q_lens[:-1] + tokens - 1) // tokens
    ends = jnp.cumsum(tiles)
    index = jnp.arange(items, dtype=jnp.int32)
    # "compare_all": an [items, S] comparison, no loop. The default method is a binary search
    # in a `while` of log2(S) steps, whose bound JAX 0.12 wraps in a sharding constraint.
    seq = jnp.minimum(jnp.searchsorted(ends, index, side="right", method="compare_all"),
                      num_seqs - 1).astype(jnp.int32)
    tile = jnp.where(index < ends[-1], index - (ends - tiles)[seq], num_tokens).astype(jnp.int32)
    return seq, tile
