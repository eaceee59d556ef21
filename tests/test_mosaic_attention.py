"""The attention kernel's Mosaic GPU form (pallas_kernels/ragged_paged_attention/mosaic_kernel.py):
under Pallas' GPU interpreter (TMA copies, barriers and wgmma simulated; JAX >= 0.11, whose
interpreter reads the transposed K operand) against the pure-JAX reference over decodes, prefill
chunks and mixed batches, GQA groups 1-16, head_dim 64/128/192, windows, split-KV and buffer
counts; lowered for cuda (both JAX versions); what it refuses, and the launches a device tunes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (Launch, candidates, candidates_of, mosaic_kernel,
                                                   ragged_paged_attention, reference, shape_of)
from tests.test_cross_lowering import attribute, custom_calls
from tests.test_ragged_paged_attention import MIXES, _quantized, make_batch
from tests.tiers import slow
from tests.internals import engine_of

needs_interpreter = pytest.mark.skipif(not mosaic_kernel.interpretable(),
                                       reason="JAX < 0.11: the GPU interpreter cannot read a transposed wgmma operand")

# (mix, (q_heads, kv_heads), head_dim, dtype, page, pages a block, splits, buffers, window); mix
# "decode" is a decode call (cu_q_lens None: one-token tiles).
CASES = [
    ("mixed", (8, 2), 64, jnp.bfloat16, 16, 4, 1, 2, 0),
    ("mixed", (8, 2), 64, jnp.float16, 16, 4, 2, 2, 20),
    ("mixed", (6, 2), 128, jnp.float16, 64, 1, 3, 3, 0),
    ("prefills", (4, 4), 64, jnp.float16, 32, 2, 1, 1, 0),
    ("chunk_at_page_boundary", (16, 1), 192, jnp.float16, 16, 4, 2, 2, 9),
    ("decode", (8, 1), 64, jnp.float16, 16, 4, 2, 2, 0),
    ("decode", (32, 8), 128, jnp.bfloat16, 16, 8, 8, 2, 0),
    ("decode", (6, 2), 64, jnp.float16, 64, 2, 4, 2, 40),
]
DECODES = [(1, 1), (1, 16), (1, 64), (1, 65), (1, 200), (1, 7)]


@needs_interpreter
@pytest.mark.parametrize("mix,heads,head_dim,dtype,page,pages,splits,stages,window", CASES,
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_mosaic_form_matches_reference(mix, heads, head_dim, dtype, page, pages, splits, stages, window):
    decode = mix == "decode"
    seqs = DECODES if decode else MIXES[mix] + [(1, 120), (3, 97)]
    rng = np.random.default_rng(head_dim * 100 + splits * 10 + stages)
    q, k, v, kv_lens, table, cu = make_batch(rng, seqs, *heads, head_dim, dtype, pages_per_seq=16, page=page,
                                             extra_rows=0 if decode else 5)
    scale = head_dim ** -0.5
    ref = np.asarray(reference(q, k, v, kv_lens, table, cu, scale, window=window), np.float32)
    out = ragged_paged_attention(q, k, v, kv_lens, table, None if decode else cu, scale=scale, window=window,
                                 form="mosaic", pages_per_block=pages, kv_splits=splits, num_stages=stages,
                                 interpret=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    valid = int(cu[-1])
    # The probabilities meet V in the KV's dtype, as in the Triton kernel: bf16 rounds at 2^-8.
    tolerance = 1e-2 if dtype == jnp.bfloat16 else 2e-3
    np.testing.assert_allclose(np.asarray(out, np.float32)[:valid], ref[:valid], rtol=tolerance,
                               atol=tolerance * np.abs(ref[:valid]).max())


@needs_interpreter
def test_mosaic_splits_split_the_keys(monkeypatch):
    """Each split walks its own span: one decode row over 8 blocks in 4 splits leaves every
    split a part of the row's mass, none all of it."""
    seen = {}
    original = mosaic_kernel.combine_splits
    monkeypatch.setattr(mosaic_kernel, "combine_splits", lambda o, m, l: seen.update(m=m, l=l) or original(o, m, l))
    q, k, v, kv_lens, table, cu = make_batch(np.random.default_rng(5), [(1, 512)], 4, 4, 64, jnp.float16,
                                             pages_per_seq=32, extra_rows=0, page=16)
    out = mosaic_kernel.attention.__wrapped__(q, k, v, kv_lens, table, None, scale=0.125, pages_per_block=4,
                                              kv_splits=4, interpret=True)  # not under jit: the partials as values
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(reference(q, k, v, kv_lens, table, cu, 0.125), np.float32),
                               rtol=2e-3, atol=2e-3)
    m, l = np.asarray(seen["m"])[:, 0, :, 0], np.asarray(seen["l"])[:, 0, :, 0]  # [splits, kv_heads]
    parts = l * np.exp(m - m.max(axis=0))
    assert np.all(parts > 0) and np.all(parts < parts.sum(axis=0) * 0.99)


def _cuda(q, k, v, kv_lens, table, cu, **launch):
    return ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=1.0, form="mosaic", platform="cuda", **launch)


def test_mosaic_form_refuses_what_it_does_not_take():
    """Each refusal names what it needs, before any kernel is built (here, not interpreted)."""
    q, k, v, kv_lens, table, cu = make_batch(np.random.default_rng(1), MIXES["decodes"], 8, 2, 64, jnp.float32,
                                             page=16)
    bf16 = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    with pytest.raises(ValueError, match="bf16 or f16"):
        _cuda(q, k, v, kv_lens, table, cu)
    with pytest.raises(ValueError, match="8-bit KV"):
        _cuda(bf16[0], _quantized(k, jnp.int8), _quantized(v, jnp.int8), kv_lens, table, cu)
    with pytest.raises(ValueError, match="head_dim 80"):
        _cuda(*(jnp.zeros(a.shape[:-1] + (80,), jnp.bfloat16) for a in (q, k, v)), kv_lens, table, cu)
    with pytest.raises(ValueError, match="16 keys a block"):
        _cuda(*bf16, kv_lens, table, cu, pages_per_block=1)
    with pytest.raises(ValueError, match="shared memory"):
        _cuda(*(jnp.zeros(a.shape[:-1] + (256,), jnp.bfloat16) for a in (q, k, v)), kv_lens, table, cu,
              pages_per_block=8, num_stages=3)
    with pytest.raises(ValueError, match="one row a sequence"):
        _cuda(bf16[0][:3], *bf16[1:], kv_lens, table, None)
    with pytest.raises(ValueError, match="NVIDIA"):
        ragged_paged_attention(*bf16, kv_lens, table, cu, scale=1.0, form="mosaic", platform="tpu")
    with pytest.raises(ValueError, match="form must be one of"):
        ragged_paged_attention(*bf16, kv_lens, table, cu, scale=1.0, form="cutlass", platform="cuda")


LLAMA_DECODE = (64, 32, 8, 128, 16, 256, "bfloat16", 0, 1)  # shape_of's key: Llama-3-8B, 64 decodes


def test_mosaic_launches_are_tuned_where_the_form_takes_the_call():
    """A bf16 decode call of Llama-3-8B's shape gets Mosaic launches (splits 1-8, 64 and 128 keys
    a block, each within shared memory, names that parse back) after the Triton ones; a ragged
    call fewer; f32, 8-bit KV and head_dim 80 none."""
    launches = candidates_of(LLAMA_DECODE)
    triton = candidates(128, 16, 256)
    assert launches[:len(triton)] == triton
    mosaic = launches[len(triton):]
    assert {launch.form for launch in mosaic} == {"mosaic"}
    assert {launch.kv_splits for launch in mosaic} == {1, 2, 4, 8}
    assert {launch.pages_per_block * 16 for launch in mosaic} == {64, 128}
    assert all(Launch.parse(launch.name) == launch for launch in mosaic)
    assert all(mosaic_kernel.shared_memory_bytes(128, launch.pages_per_block * 16, launch.num_stages)
               <= mosaic_kernel.SHARED_MEMORY_BYTES for launch in mosaic)
    ragged = [launch for launch in candidates_of(LLAMA_DECODE[:-1] + (0,)) if launch.form == "mosaic"]
    assert 0 < len(ragged) < len(mosaic)
    for other in [LLAMA_DECODE[:6] + ("float32",) + LLAMA_DECODE[7:], LLAMA_DECODE[:6] + ("int8",) + LLAMA_DECODE[7:],
                  LLAMA_DECODE[:3] + (80,) + LLAMA_DECODE[4:]]:
        assert all(launch.form is None for launch in candidates_of(other)), other
    q = jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((8, 1024, 16, 128), jnp.bfloat16)
    assert shape_of(q, k, jax.ShapeDtypeStruct((64, 256), jnp.int32), 0, decode=True) == LLAMA_DECODE


@pytest.mark.parametrize("decode,head_dim,window", [(True, 128, 0), (False, 128, 0), (False, 64, 4096)])
def test_mosaic_form_lowers_for_cuda(decode, head_dim, window):
    """Mosaic GPU's lowering runs here at Llama-3-8B's shape (64 decodes; a 128-token ragged batch
    of 8 sequences) and a windowed head_dim-64 one; only the final compile needs a GPU."""
    from cbjax.runtime.compiled.lowering import lowering_target

    seqs, tokens = (64, 64) if decode else (8, 128)
    args = (jax.ShapeDtypeStruct((tokens, 32, head_dim), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((8, 1024, 16, head_dim), jnp.bfloat16)] * 2,
            jax.ShapeDtypeStruct((seqs,), jnp.int32), jax.ShapeDtypeStruct((seqs, 256), jnp.int32),
            None if decode else jax.ShapeDtypeStruct((seqs + 1,), jnp.int32))
    fn = jax.jit(lambda q, k, v, lens, table, cu: ragged_paged_attention(
        q, k, v, lens, table, cu, scale=0.1, window=window, form="mosaic", pages_per_block=4, kv_splits=2))
    with lowering_target("cuda"):
        lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
    assert [attribute(c, "call_target_name") for c in custom_calls(lowered)] == ["mosaic_gpu_v2"]


@needs_interpreter
@slow
def test_an_engine_tuned_to_the_mosaic_form_gives_the_reference_engines_tokens(tmp_path, monkeypatch):
    """A paged f16 engine whose tuning (a fake timer that prefers one Mosaic GPU launch and
    runs it, interpreted) chose the Mosaic GPU form for every attention call: its programs, traced
    after the tuning, run that form (in the GPU interpreter on this CPU) and give the greedy tokens
    of the engine with the reference attention."""
    from cbjax import LLM, SamplingParams
    from cbjax.loading.model import Model
    from cbjax.loading.presets import RANDOM_PRESETS
    from cbjax.models.params import init_params
    from cbjax.runtime.compiled import kernel_tuning
    from pallas_kernels import tuning

    config = dataclasses.replace(RANDOM_PRESETS["tiny-llama"], head_dim=64)
    model = Model(config, init_params(config, seed=3, dtype=jnp.float16))
    options = dict(num_slots=2, max_seq_len=128, kv_cache="paged", page_size=16, dtype="float16", kernel_tuning="off")
    prompts, sampling = [[5, 9, 14, 3, 22, 8, 31], [17, 4, 4, 60, 2, 40, 11, 19, 27, 33]], SamplingParams(max_tokens=5)
    want = [o.token_ids for o in LLM(model, attention="reference", **options).generate(prompts, sampling,
                                                                                     use_tqdm=False)]
    llm = LLM(model, attention="pallas", **options)
    chosen = Launch(form="mosaic", pages_per_block=4, num_stages=2, kv_splits=4).name

    def timer(name, run):
        if name == chosen:
            jax.block_until_ready(run())
        return 0.5 if name == chosen else 1.0

    tuning.forget()
    try:
        choices = kernel_tuning.tune_kernels(engine_of(llm), cache=tuning.TuningCache(tmp_path / tuning.FILE_NAME),
                                             device_kind="NVIDIA H200", timer=timer, interpret=True)
        assert choices and set(choices.values()) == {chosen}
        seen = []
        original = mosaic_kernel.attention
        monkeypatch.setattr(mosaic_kernel, "attention",
                            lambda *a, **kw: seen.append(kw["kv_splits"]) or original(*a, **kw))
        got = [o.token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)]
    finally:
        tuning.forget()
        jax.clear_caches()
    assert seen and set(seen) == {4}
    assert got == want


def test_work_items_are_the_tiles_that_hold_tokens():
    """The grid's items: each sequence's tiles of up to `tokens` tokens in order, none for an
    empty sequence, and every item past the last given a tile past its sequence (it exits)."""
    cu = jnp.asarray([0, 1, 1, 18, 19, 27], jnp.int32)  # q lengths 1, 0, 17, 1, 8
    seq, tile = mosaic_kernel._work_items(cu, num_tokens=32, tokens=8)
    assert seq.shape == (5 + 32 // 8,)
    pairs = [(int(s), int(t)) for s, t in zip(seq, tile)]
    assert pairs[:6] == [(0, 0), (2, 0), (2, 1), (2, 2), (3, 0), (4, 0)]
    assert all(t * 8 >= 32 for _, t in pairs[6:])
