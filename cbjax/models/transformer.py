"""One pure-functional decoder for every supported family, over the slot cache.

`forward` runs a chunk of `T` tokens for `B` sequences. Sequence `b` lives in
cache slot `slot_ids[b]`; its chunk starts at absolute position `starts[b]` and
its first `num_valid[b]` tokens are real (the rest is bucket padding). Every query
attends to its slot's cached positions before `starts[b]` (read from the first
`kv_len` positions, a static bucket) and to the chunk's own keys up to itself; each
layer writes the chunk's keys and values into its own cache array before reading it.
So:

- a fresh prefill is `B=1` (or a few) rows with `starts=0` and `kv_len=0`: no cache read;
- a chunked prefill has `starts` = what the slot already holds, `kv_len` covering it;
- a decode step is `T=1`, one row per slot, `starts = cache.lengths`,
  `num_valid` 1 for active slots and 0 for idle ones (whose writes are dropped);
- the mixed step is `T=1` rows of a flat token buffer, `flat_rows` saying which tokens
  belong to one sequence (they see each other's new keys) and `history_end` where
  that sequence's cached history ends.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cbjax.config import ModelConfig
from cbjax.models.fusion import split_qkv
from cbjax.models.ops import XLA, Ops
from cbjax.models.attention import attention_part, flat_self_part, merge_parts, visible
from cbjax.models.kv_cache import KVCache, QuantizedKV, as_stored, rotate
from cbjax.models.quant import activation_dtype, embedding_rows
from cbjax.models.moe import moe_mlp
from cbjax.models.lora import TokenAdapters, layer_adapters
from cbjax.models.layers import apply_rope, dense, mlp, norm, rms_norm, rope_inv_freq, rope_tables


def qkv_projections(x, p, config, cos, sin, ops: Ops = XLA, lora: TokenAdapters | None = None, layer: int = 0):
    b, t, _ = x.shape
    hd = config.head_dim
    h = norm(x, p["attn_norm"], config)
    if "wqkv" in p:  # one product for the three (cbjax/models/fusion.py)
        q, k, v = split_qkv(dense(h, p["wqkv"], p.get("bqkv"), ops), config)
    else:
        q, k, v = (dense(h, p[w], p.get(bias), ops) for w, bias in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    if lora is not None:  # each token's adapter, on the projections' outputs as PEFT adds it
        q, k, v = (lora.add(y, h, module, layer) for y, module in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
    if config.qk_norm_whole:  # OLMoE: over each token's whole projection, before the heads split
        q, k = rms_norm(q, p["q_norm"], config.norm_eps), rms_norm(k, p["k_norm"], config.norm_eps)
    if config.clip_qkv is not None:
        q, k, v = (jnp.clip(a, -config.clip_qkv, config.clip_qkv) for a in (q, k, v))
    q = q.reshape(b, t, config.num_heads, hd)
    k, v = k.reshape(b, t, config.num_kv_heads, hd), v.reshape(b, t, config.num_kv_heads, hd)
    if config.qk_norm and not config.qk_norm_whole:
        q = rms_norm(q, p["q_norm"], config.norm_eps)
        k = rms_norm(k, p["k_norm"], config.norm_eps)
    if config.position_embedding == "rope":
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
    return q, k, v


def _kernel_attention(q, cache, layer_k, layer_v, slot_ids, starts, ragged, window, platform):
    """Attention by the ragged Pallas kernel over the layer's cache, paged or slots (a slot read
    as a run of pages): the platform's kernel, on a CPU its body in interpret mode. `ragged`:
    a flat mixed batch, one token per row (cu_q_lens, kv_lens, row slots); None: a decode
    step, one token per row and sequence. `platform`: the one traced for (`Ops.platform`)."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    if ragged is None:  # one row a sequence: the kernel may take its decode form (cu_q_lens None)
        ragged = (None, starts + 1, slot_ids)
    cu_q_lens, kv_lens, row_slots = ragged
    k_pages, v_pages, tables = cache.kernel_view(layer_k, layer_v, row_slots)
    # The kernel loads each page once per query tile of a sequence, not once per token.
    return ragged_paged_attention(q[:, 0], k_pages, v_pages, kv_lens, tables, cu_q_lens, scale=q.shape[-1] ** -0.5,
                                  window=window, platform=platform)[:, None]


def _blocked_history(q, cache, layer_k, layer_v, window, slot_ids, positions, history_end, valid, block, scale):
    """The history part read in blocks of `block` positions, as many as the longest history
    among the valid rows needs: the read is sized by the data, not by a static length, so
    one program serves every attended length (a flash-attention style running merge)."""
    b, t, hq, d = q.shape
    kv_heads = layer_k.shape[cache.head_axis]
    shape = (b, kv_heads, hq // kv_heads, t)
    longest = jnp.max(jnp.where(valid, history_end, 0))
    max_len = cache.max_len

    def one_block(j, carry):
        out, top, total = carry
        lo = j * block
        at = jnp.minimum(lo, max_len - block)  # the last block may overlap the one before it
        k_pos = at + jnp.arange(block, dtype=jnp.int32)[None, None, :]
        mask = ((k_pos >= lo) & (k_pos < history_end[:, None, None])
                & visible(positions[:, :, None], k_pos, window))
        o, m, s = attention_part(q, cache.read_block(layer_k, slot_ids, at, block),
                                 cache.read_block(layer_v, slot_ids, at, block), mask, scale)
        new_top = jnp.maximum(top, m)
        old, now = jnp.exp(top - new_top), jnp.exp(m - new_top)
        return out * old[..., None] + o * now[..., None], new_top, total * old + s * now

    init = (jnp.zeros(shape + (d,), jnp.float32), jnp.full(shape, -1e30, jnp.float32), jnp.zeros(shape, jnp.float32))
    return jax.lax.fori_loop(0, (longest + block - 1) // block, one_block, init)


def _reference_attention(q, k, v, cache, layer_k, layer_v, window, slot_ids, positions, history_end, num_valid,
                         kv_len, all_slots, flat_rows, ops: Ops = XLA, history_block=None):
    """The layer cache's first `kv_len` positions before `history_end` (the history) plus
    the new keys `k`/`v` (`[B, T, kv_heads, d]`), merged by their softmax statistics.
    `history_block`: read the history in blocks up to the longest one instead (kv_len unused).
    `ops` may read the history its own way (the CPU kernel: each row only up to its length)."""
    scale = q.shape[-1] ** -0.5
    t = q.shape[1]
    parts = []
    own = None
    if kv_len:
        # The same history part, each row reading its keys once up to its own length
        pos = positions[:, 0]
        lo = jnp.maximum(pos - window + 1, 0) if window else jnp.zeros_like(pos)
        hi = jnp.minimum(jnp.minimum(history_end, pos + 1), kv_len)
        own = ops.history_attention(q, cache, layer_k, layer_v, slot_ids, lo, hi)
    if own is not None:
        parts.append(own)
    elif kv_len and history_block:
        parts.append(_blocked_history(q, cache, layer_k, layer_v, window, slot_ids, positions, history_end,
                                      num_valid > 0, history_block, scale))
    elif kv_len:  # 0: nothing precedes the chunk (a fresh prefill), no cache read at all
        k_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
        mask = (k_pos < history_end[:, None, None]) & visible(positions[:, :, None], k_pos, window)
        keys = cache.read(layer_k, slot_ids, kv_len, all_slots)
        values = cache.read(layer_v, slot_ids, kv_len, all_slots)
        parts.append(attention_part(q, keys, values, mask, scale))
    if flat_rows is None:
        offsets = jnp.arange(t, dtype=jnp.int32)
        mask = visible(positions[:, :, None], positions[:, None, :], window) & (offsets < num_valid[:, None])[:, None, :]
        parts.append(attention_part(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask, scale))
    else:  # one token per row: tokens of the same sequence see each other's new keys
        pos = positions[:, 0]
        mask = ((flat_rows[:, None] == flat_rows[None, :]) & visible(pos[:, None], pos[None, :], window)
                & (num_valid > 0)[None, :])
        parts.append(flat_self_part(q, k, v, mask, scale))
    return merge_parts(parts, q.shape, q.dtype)


def forward(
    params: dict,
    config: ModelConfig,
    cache: KVCache,
    tokens: jax.Array,  # [B, T] int32
    starts: jax.Array,  # [B] int32
    num_valid: jax.Array | None = None,  # [B] int32; default T
    slot_ids: jax.Array | None = None,  # [B] int32; default arange(B)
    kv_len: int | None = None,  # static; default cache.max_len
    logits_index: jax.Array | None = None,  # [B]: return logits only at these chunk offsets
    attention_kernel: bool = False,  # static: attention by the ragged Pallas kernel (either cache layout)
    logits_rows: jax.Array | None = None,  # [R]: return logits only of these rows (T == 1)
    ragged: tuple | None = None,  # flat mixed batch for the ragged kernel: (cu_q_lens, kv_lens, row slots)
    flat_rows: jax.Array | None = None,  # [B] with T == 1: tokens of one sequence in a flat buffer share a row id
    history_end: jax.Array | None = None,  # [B]: cache positions before this are history (default: starts)
    embed: bool = True,  # static; False: `tokens` are hidden states [B, T, hidden] (a later pipeline stage)
    head: bool = True,  # static; False: return the hidden states after the last layer (an earlier stage)
    first_layer: int = 0,  # static: the model layer that params["layers"][0] is (pipeline stages)
    ops: Ops = XLA,  # static: the backend's operations (cbjax/models/ops.py)
    history_block: int | None = None,  # static: read the history in blocks up to the longest (not kv_len)
    routing: bool = False,  # static: also return the tokens each MoE layer sent to each expert
    adapters: jax.Array | None = None,  # [B]: each row's LoRA slot in params["lora"] (cbjax/models/lora.py)
) -> tuple[jax.Array, KVCache]:
    """Returns `(logits, cache)`: logits `[B, T, vocab]` (or `[B, vocab]` with
    `logits_index`) in float32, and the cache with the chunk written and
    `lengths[slot_ids] = starts + num_valid`. A pipeline stage runs only its layers
    (`params["layers"]` and `cache` hold just those): `embed`/`head` say whether it
    starts from token ids and ends in logits. `routing`: `(logits, cache, tokens per expert)`,
    the last `[MoE layers, experts]` int32 over the valid tokens (cbjax/models/moe.py)."""
    b, t = tokens.shape[:2]
    max_len = cache.max_len
    kv_len = max_len if kv_len is None else kv_len
    all_slots = slot_ids is None
    if all_slots:
        if b != cache.num_slots:
            raise ValueError(f"without slot_ids the batch ({b}) must cover every slot ({cache.num_slots})")
        slot_ids = jnp.arange(b, dtype=jnp.int32)
    if num_valid is None:
        num_valid = jnp.full((b,), t, jnp.int32)
    starts = starts.astype(jnp.int32)
    offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = starts[:, None] + offsets

    if embed:
        x = embedding_rows(params["embed"], tokens, activation_dtype(params))
        if config.position_embedding == "learned":
            pos_table = params["pos_embed"]
            x = x + pos_table[jnp.clip(positions, 0, pos_table.shape[0] - 1)]
    else:
        x = tokens
    cos, sin = rope_tables(positions, rope_inv_freq(config))
    history_end = starts if history_end is None else history_end
    ks, vs = list(cache.k), list(cache.v)
    expert_tokens = []
    lora = layer_adapters(params, adapters, ops)
    # The layers are a Python loop over per-layer weight and cache arrays, not a lax.scan over
    # stacked ones: the scan compiles faster and runs about as fast on XLA:CPU with XLA's
    # matmuls (experiments/benchmarks/bench_layer_loop.py; docs/engine.md, "The step's figures").
    # Kept unrolled on every backend for now because the engine's
    # CPU decode sends its matmuls to the C++ kernels (an FFI call cannot read a scanned slice
    # in place: 3x the weight traffic measured) and a loop-carried stacked cache was copied
    # around its reads; on an accelerator the scan's compile time is the open question.
    for layer, p in enumerate(params["layers"]):
        window = config.windows[first_layer + layer]
        whole = None if attention_kernel else ops.decoder_layer(
            x, p, config, cache, ks[layer], vs[layer], slot_ids, positions, num_valid, cos, sin, window,
            **({} if lora is None else {"lora": lora}))
        if whole is not None:
            x, ks[layer], vs[layer] = whole
            continue
        q, k, v = qkv_projections(x, p, config, cos, sin, ops, lora, first_layer + layer)
        rotated = isinstance(ks[layer], QuantizedKV)  # an 8-bit cache holds rotated vectors (kv_rotation)
        if rotated:
            q, k, v = (rotate(a, config.head_dim) for a in (q, k, v))
        # Written before it is read: the read then depends on the write, so XLA updates the
        # layer's buffer in place instead of keeping a copy of the old one for the read
        # (written after, every layer's cache was copied twice per call).
        ks[layer] = cache.write(ks[layer], slot_ids, starts, num_valid, k)
        vs[layer] = cache.write(vs[layer], slot_ids, starts, num_valid, v)
        if attention_kernel:
            out = _kernel_attention(q, cache, ks[layer], vs[layer], slot_ids, starts, ragged, window, ops.platform)
        else:
            k, v = as_stored(k, ks[layer]), as_stored(v, vs[layer])  # as the kernel reads them back
            out = _reference_attention(q, k, v, cache, ks[layer], vs[layer], window, slot_ids, positions,
                                       history_end, num_valid, kv_len, all_slots, flat_rows, ops,
                                       history_block)
        if rotated:
            out = rotate(out, config.head_dim, back=True)
        out = out.reshape(b, t, -1)
        o = dense(out, p["wo"], p.get("bo"), ops)
        x = x + (o if lora is None else lora.add(o, out, "o_proj", first_layer + layer))
        h = norm(x, p["mlp_norm"], config)
        if "router" in p:
            out, counts = moe_mlp(h, p, config, offsets < num_valid[:, None], ops)
            x = x + out
            expert_tokens.append(counts)
        else:
            x = x + mlp(h, p, config, ops, lora, first_layer + layer)
    if cache.kv_sharding is not None:  # keep the donated cache's layout, so the next call neither
        # reshards it nor compiles again for a new input sharding
        ks, vs = ([jax.lax.with_sharding_constraint(a, cache.kv_sharding) for a in kv] for kv in (ks, vs))

    # Rows with nothing valid (idle slots, batch padding) leave their slot's length alone.
    touched = jnp.where(num_valid > 0, slot_ids, cache.num_slots)
    lengths = cache.lengths.at[touched].set(starts + num_valid, mode="drop")
    cache = dataclasses.replace(cache, k=tuple(ks), v=tuple(vs), lengths=lengths)
    output = _output(x, params, config, b, head, logits_rows, logits_index, ops)
    if routing:
        return output, cache, (jnp.stack(expert_tokens) if expert_tokens
                               else jnp.zeros((0, max(config.num_experts, 1)), jnp.int32))
    return output, cache


def _output(x, params, config, b, head, logits_rows, logits_index, ops):
    """The hidden states (`head` False) or the logits (float32) of the rows asked for."""
    if not head:
        return x
    if logits_rows is not None:
        x = x[logits_rows, 0]
    elif logits_index is not None:
        x = x[jnp.arange(b), logits_index]
    x = norm(x, params["final_norm"], config)
    # Contract against the rows of `[vocab, hidden]`: `x @ embed.T` made XLA:CPU copy the whole
    # transposed embedding (113 MB for SmolLM2) in every decode step.
    logits = dense(x, params["embed"] if config.tie_embeddings else params["lm_head"], ops=ops)
    return logits.astype(jnp.float32)
