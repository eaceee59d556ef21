"""One pure-functional decoder for every supported family, over the slot cache.

`forward` runs a chunk of `T` tokens for `B` sequences. Sequence `b` lives in
cache slot `slot_ids[b]`; its chunk starts at absolute position `starts[b]` and
its first `num_valid[b]` tokens are real (the rest is bucket padding). The
chunk's keys and values are written into the slot, then every query attends to
its slot's first `kv_len` positions. So:

- a prefill is `B=1` (or a few) rows with `starts=0`, `kv_len` = the bucket;
- a chunked prefill is the same with `starts` = what the slot already holds;
- a decode step is `T=1`, one row per slot, `starts = cache.lengths`,
  `num_valid` 1 for active slots and 0 for idle ones (whose writes are dropped).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cbjax.models.attention import attention_mask, reference_attention
from cbjax.config import ModelConfig
from cbjax.models.kv_cache import KVCache
from cbjax.models.layers import apply_rope, dense, mlp, norm, rms_norm, rope_inv_freq, rope_tables


def _attention_block(x, p, config, cache, cos, sin, q_positions, k_all, v_all, layer, window,
                     slot_ids, starts, num_valid, kv_len, all_slots, paged_kernel, ragged):
    b, t, _ = x.shape
    hd = config.head_dim
    h = norm(x, p["attn_norm"], config)
    q = dense(h, p["wq"], p.get("bq")).reshape(b, t, config.num_heads, hd)
    k = dense(h, p["wk"], p.get("bk")).reshape(b, t, config.num_kv_heads, hd)
    v = dense(h, p["wv"], p.get("bv")).reshape(b, t, config.num_kv_heads, hd)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.norm_eps)
        k = rms_norm(k, p["k_norm"], config.norm_eps)
    if config.position_embedding == "rope":
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

    k_all = cache.write(k_all, layer, slot_ids, starts, num_valid, k)
    v_all = cache.write(v_all, layer, slot_ids, starts, num_valid, v)
    if paged_kernel and ragged is not None:
        # A flat mixed batch (one token per row): the ragged kernel attends each sequence's
        # new tokens over its pages, loading each page once per query tile, not per token.
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention

        cu_q_lens, kv_lens, row_slots = ragged
        out = ragged_paged_attention(q[:, 0], jax.lax.dynamic_index_in_dim(k_all, layer, keepdims=False),
                                     jax.lax.dynamic_index_in_dim(v_all, layer, keepdims=False), kv_lens,
                                     cache.block_tables[row_slots], cu_q_lens, scale=hd ** -0.5,
                                     interpret=jax.default_backend() == "cpu")[:, None]
    elif paged_kernel and t == 1:
        # Decode over the page pool with the Pallas kernel: each query sees its slot's
        # first starts + 1 positions (interpret mode where there is no GPU).
        from pallas_kernels.paged_attention import paged_attention

        out = paged_attention(q[:, 0], jax.lax.dynamic_index_in_dim(k_all, layer, keepdims=False),
                              jax.lax.dynamic_index_in_dim(v_all, layer, keepdims=False),
                              cache.block_tables[slot_ids], starts + 1, scale=hd ** -0.5,
                              interpret=jax.default_backend() == "cpu",
                              backend="tpu" if jax.default_backend() == "tpu" else "triton")[:, None]
    else:
        keys = cache.read(k_all, layer, slot_ids, kv_len, all_slots).astype(q.dtype)
        values = cache.read(v_all, layer, slot_ids, kv_len, all_slots).astype(q.dtype)
        mask = attention_mask(q_positions, kv_len, window)
        out = reference_attention(q, keys, values, mask, scale=hd ** -0.5)
    x = x + dense(out.reshape(b, t, -1), p["wo"], p.get("bo"))
    return x, k_all, v_all


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
    paged_kernel: bool = False,  # static: decode attention by the Pallas kernel (paged cache)
    logits_rows: jax.Array | None = None,  # [R]: return logits only of these rows (T == 1)
    ragged: tuple | None = None,  # flat mixed batch for the ragged kernel: (cu_q_lens, kv_lens, row slots)
    embed: bool = True,  # static; False: `tokens` are hidden states [B, T, hidden] (a later pipeline stage)
    head: bool = True,  # static; False: return the hidden states after the last layer (an earlier stage)
    first_layer: int = 0,  # static: the model layer that params["layers"][0] is (pipeline stages)
) -> tuple[jax.Array, KVCache]:
    """Returns `(logits, cache)`: logits `[B, T, vocab]` (or `[B, vocab]` with
    `logits_index`) in float32, and the cache with the chunk written and
    `lengths[slot_ids] = starts + num_valid`. A pipeline stage runs only its layers
    (`params["layers"]` and `cache` hold just those): `embed`/`head` say whether it
    starts from token ids and ends in logits."""
    b, t = tokens.shape[:2]
    if paged_kernel and (not hasattr(cache, "block_tables") or any(config.windows)):
        raise ValueError("the Pallas decode kernel needs the paged cache and full (non-sliding) attention")
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
        x = params["embed"][tokens]
        if config.position_embedding == "learned":
            pos_table = params["pos_embed"]
            x = x + pos_table[jnp.clip(positions, 0, pos_table.shape[0] - 1)]
    else:
        x = tokens
    cos, sin = rope_tables(positions, rope_inv_freq(config))
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    windows = jnp.asarray(config.windows[first_layer:first_layer + num_layers], jnp.int32)

    def layer_step(carry, xs):
        x, k_all, v_all = carry
        p, layer, window = xs
        x, k_all, v_all = _attention_block(
            x, p, config, cache, cos, sin, positions, k_all, v_all, layer, window, slot_ids, starts, num_valid,
            kv_len, all_slots, paged_kernel, ragged)
        x = x + mlp(norm(x, p["mlp_norm"], config), p, config)
        return (x, k_all, v_all), None

    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)  # indices into this cache's layers
    (x, k_all, v_all), _ = jax.lax.scan(
        layer_step, (x, cache.k, cache.v), (params["layers"], layer_ids, windows))
    if cache.kv_sharding is not None:  # keep the donated cache's layout, so the next call neither
        # reshards it nor compiles again for a new input sharding
        k_all, v_all = (jax.lax.with_sharding_constraint(a, cache.kv_sharding) for a in (k_all, v_all))

    # Rows with nothing valid (idle slots, batch padding) leave their slot's length alone.
    touched = jnp.where(num_valid > 0, slot_ids, cache.num_slots)
    lengths = cache.lengths.at[touched].set(starts + num_valid, mode="drop")
    cache = dataclasses.replace(cache, k=k_all, v=v_all, lengths=lengths)
    if not head:
        return x, cache
    if logits_rows is not None:
        x = x[logits_rows, 0]
    elif logits_index is not None:
        x = x[jnp.arange(b), logits_index]
    x = norm(x, params["final_norm"], config)
    if config.tie_embeddings:
        # Contract against the embedding's own rows: `x @ embed.T` made XLA:CPU copy the whole
        # transposed embedding (113 MB for SmolLM2) in every decode step.
        logits = jnp.einsum("...d,vd->...v", x, params["embed"])
    else:
        logits = x @ params["lm_head"]
    return logits.astype(jnp.float32), cache
