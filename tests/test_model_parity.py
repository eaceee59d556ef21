"""Every family against transformers: full-sequence logits and prefill + decode through the slot cache."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.loading import load_hf_dir
from cbjax.models.kv_cache import SlotCache
from cbjax.models import forward
from tests.hf_models import FAMILIES, hf_logits, make_hf_model, save_hf_model

RTOL = 1e-4
DECODE_STEPS = 16

jit_forward = jax.jit(forward, static_argnames=("config", "kv_len"))


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pair(request, tmp_path_factory):
    """(family name, transformers model, cbjax Model) for each family."""
    hf = make_hf_model(request.param)
    path = save_hf_model(hf, str(tmp_path_factory.mktemp(request.param)))
    return request.param, hf, load_hf_dir(path, with_tokenizer=False)


def test_full_sequence_logits_match_transformers(family_pair):
    family, hf, model = family_pair
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.config.vocab_size, size=(2, 40))
    ref = hf_logits(hf, tokens)
    cache = SlotCache.init(model.config, 2, 64)
    logits, _ = jit_forward(model.params, model.config, cache, jnp.asarray(tokens), jnp.zeros(2, jnp.int32))
    err = rel_err(logits, ref)
    print(f"{family}: full-sequence relative error {err:.2e}")
    assert err < RTOL, f"{family}: relative error {err:.2e}"


def test_prefill_then_decode_matches_full_forward(family_pair):
    """Two prompts of different lengths, prefilled into slots 2 and 0 with bucket padding,
    then decoded together one token at a time (slot 1 idle): every step's logits equal the
    full forward's logits at that position."""
    family, hf, model = family_pair
    cfg = model.config
    rng = np.random.default_rng(2)
    lengths = [11, 5]
    slots = [2, 0]
    seqs = [rng.integers(0, cfg.vocab_size, size=n + DECODE_STEPS) for n in lengths]
    full = [hf_logits(hf, s[None])[0] for s in seqs]

    cache = SlotCache.init(cfg, 3, 64)
    for seq, n, slot in zip(seqs, lengths, slots):
        bucket = np.zeros(16, np.int32)
        bucket[:n] = seq[:n]
        logits, cache = jit_forward(model.params, cfg, cache, jnp.asarray(bucket[None]), jnp.zeros(1, jnp.int32),
                                    num_valid=jnp.asarray([n]), slot_ids=jnp.asarray([slot]), kv_len=16)
        ref = full[slots.index(slot)][:n]
        assert rel_err(np.asarray(logits)[0, :n], ref) < RTOL
    assert list(np.asarray(cache.lengths)) == [5, 0, 11]

    worst = 0.0
    for step in range(DECODE_STEPS):
        tokens = np.zeros((3, 1), np.int32)
        for seq, n, slot in zip(seqs, lengths, slots):
            tokens[slot, 0] = seq[n + step]
        active = jnp.asarray([1, 0, 1], jnp.int32)
        logits, cache = jit_forward(model.params, cfg, cache, jnp.asarray(tokens), cache.lengths, num_valid=active)
        for seq, n, slot in zip(seqs, lengths, slots):
            err = rel_err(np.asarray(logits)[slot, 0], full[slots.index(slot)][n + step])
            worst = max(worst, err)
    print(f"{family}: decode relative error {worst:.2e}")
    assert worst < RTOL, f"{family}: decode relative error {worst:.2e}"
    assert list(np.asarray(cache.lengths)) == [5 + DECODE_STEPS, 0, 11 + DECODE_STEPS]


def test_chunked_prefill_matches_full_forward(family_pair):
    """A prompt prefilled in three chunks (the last one padded) gives the full forward's logits."""
    family, hf, model = family_pair
    cfg = model.config
    seq = np.random.default_rng(3).integers(0, cfg.vocab_size, size=37)
    ref = hf_logits(hf, seq[None])[0]
    cache = SlotCache.init(cfg, 2, 64)
    got = []
    for start in range(0, 37, 16):
        n = min(16, 37 - start)
        chunk = np.zeros(16, np.int32)
        chunk[:n] = seq[start:start + n]
        logits, cache = jit_forward(model.params, cfg, cache, jnp.asarray(chunk[None]), jnp.asarray([start]),
                                    num_valid=jnp.asarray([n]), slot_ids=jnp.asarray([1]))
        got.append(np.asarray(logits)[0, :n])
    assert rel_err(np.concatenate(got), ref) < RTOL


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = make_hf_model("llama", seed=5)
    single = load_hf_dir(save_hf_model(hf, str(tmp_path / "single")), with_tokenizer=False)
    sharded_dir = save_hf_model(hf, str(tmp_path / "sharded"), max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded_dir, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded_dir) if f.endswith(".safetensors")]) > 2
    sharded = load_hf_dir(sharded_dir, with_tokenizer=False)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_close_to_transformers_bfloat16(family, tmp_path):
    import torch

    hf = make_hf_model(family)
    path = save_hf_model(hf, str(tmp_path))
    model = load_hf_dir(path, dtype="bfloat16", with_tokenizer=False)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.params))
    tokens = np.random.default_rng(4).integers(0, model.config.vocab_size, size=(1, 24))
    ref32 = hf_logits(hf, tokens)
    ref16 = hf_logits(hf.to(torch.bfloat16), tokens)
    cache = SlotCache.init(model.config, 1, 32, jnp.bfloat16)
    logits, _ = jit_forward(model.params, model.config, cache, jnp.asarray(tokens), jnp.zeros(1, jnp.int32))
    # bfloat16 keeps 8 mantissa bits: we ask to be as close to float32 as transformers'
    # own bfloat16 run is (with a little slack), not to match its rounding bit for bit.
    ours, theirs = rel_err(logits, ref32), rel_err(ref16, ref32)
    print(f"{family} bf16: ours vs f32 {ours:.2e}, transformers bf16 vs f32 {theirs:.2e}")
    assert ours < max(2 * theirs, 2e-2)
