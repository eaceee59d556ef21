"""The model over the paged cache gives the slot cache's logits (prefill, chunked prefill, decode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.loading import load_model
from cbjax.models.kv_cache import PagedCache, SlotCache
from cbjax.models import forward

jit_forward = jax.jit(forward, static_argnames=("config", "kv_len"))
PAGE = 4
MAX_LEN = 64


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-mistral"])
def test_paged_matches_slot_cache(preset):
    model = load_model(preset, seed=1)
    cfg = model.config
    rng = np.random.default_rng(0)
    slots, pages_per_seq = 3, MAX_LEN // PAGE
    num_pages = slots * pages_per_seq + 5
    tables = rng.permutation(num_pages)[:slots * pages_per_seq].reshape(slots, pages_per_seq)
    paged = PagedCache.init(cfg, slots, MAX_LEN, num_pages, PAGE)
    paged.block_tables = jnp.asarray(tables, jnp.int32)
    slot = SlotCache.init(cfg, slots, MAX_LEN)
    prompts = {0: rng.integers(3, cfg.vocab_size, size=13), 2: rng.integers(3, cfg.vocab_size, size=21)}

    def both(tokens, starts, **kw):
        nonlocal paged, slot
        a, paged = jit_forward(model.params, cfg, paged, tokens, starts, **kw)
        b, slot = jit_forward(model.params, cfg, slot, tokens, starts, **kw)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
        return np.asarray(a)

    # Slot 0: whole prefill in a padded bucket; slot 2: chunked prefill (16 then 5).
    bucket = np.zeros(16, np.int32)
    bucket[:13] = prompts[0]
    both(jnp.asarray(bucket[None]), jnp.zeros(1, jnp.int32), num_valid=jnp.asarray([13]), slot_ids=jnp.asarray([0]),
         kv_len=16)
    both(jnp.asarray(prompts[2][None, :16]), jnp.zeros(1, jnp.int32), slot_ids=jnp.asarray([2]), kv_len=16)
    chunk = np.zeros(16, np.int32)
    chunk[:5] = prompts[2][16:]
    both(jnp.asarray(chunk[None]), jnp.asarray([16]), num_valid=jnp.asarray([5]), slot_ids=jnp.asarray([2]),
         kv_len=32)
    for step in range(12):
        tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(slots, 1)), jnp.int32)
        both(tokens, paged.lengths, num_valid=jnp.asarray([1, 0, 1]), kv_len=MAX_LEN)
    assert list(np.asarray(paged.lengths)) == list(np.asarray(slot.lengths)) == [25, 0, 33]
    # Pages that no table names were never written.
    unused = sorted(set(range(num_pages)) - set(tables.ravel().tolist()))
    assert not np.stack(paged.k)[:, :, unused].any()


def test_decode_through_the_pallas_kernel_matches_the_reference_path():
    """The model's paged decode with the ragged Pallas kernel (one query row per sequence;
    interpret mode on CPU) gives the reference path's logits. Pages of 8: the kernels' least."""
    model = load_model("tiny-qwen3", seed=2)
    cfg = model.config
    rng = np.random.default_rng(1)
    page = 8
    slots, pages_per_seq = 3, MAX_LEN // page
    num_pages = slots * pages_per_seq
    cache = PagedCache.init(cfg, slots, MAX_LEN, num_pages, page)
    cache.block_tables = jnp.asarray(rng.permutation(num_pages).reshape(slots, pages_per_seq), jnp.int32)
    for slot, n in ((0, 9), (1, 17), (2, 4)):
        prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(1, n)), jnp.int32)
        _, cache = jit_forward(model.params, cfg, cache, prompt, jnp.zeros(1, jnp.int32),
                               slot_ids=jnp.asarray([slot]), kv_len=32)
    step = jax.jit(forward, static_argnames=("config", "kv_len", "attention_kernel"))
    for _ in range(3):
        tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(slots, 1)), jnp.int32)
        active = jnp.asarray([1, 1, 0], jnp.int32)
        ref, _ = step(model.params, cfg, cache, tokens, cache.lengths, num_valid=active)
        out, cache = step(model.params, cfg, cache, tokens, cache.lengths, num_valid=active, attention_kernel=True)
        np.testing.assert_allclose(np.asarray(out)[:2], np.asarray(ref)[:2], atol=2e-5, rtol=2e-5)
