"""Weight-only int8 quantization (EngineArgs.quantization): greedy tokens identical to the same
engine on the dequantized f32 weights (the same arithmetic) for every family and both cache
layouts, logits near the unquantized model's, resident bytes, tensor-parallel shards, orbax
round trips, and the knobs' errors."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.loading import load_model
from cbjax.loading.orbax_io import load_orbax, save_orbax
from cbjax.models import forward, quant
from cbjax.models.kv_cache import SlotCache
from tests.hf_models import FAMILIES, make_hf_model, save_hf_model
from tests.tiers import slow, sweep
from tests.internals import engine_of, scheduler_of

PROMPTS = [[5, 9, 14, 3, 22, 8, 31], [17, 4, 4, 60], [2, 40, 11, 19, 27, 33, 6, 12, 50]]


def dequantized(model):
    params = jax.tree.map(lambda x: x.dequantize(jnp.float32) if quant.is_quantized(x) else x,
                          model.params, is_leaf=quant.is_quantized)
    return dataclasses.replace(model, params=params)


def tokens(llm: LLM, max_tokens: int = 12) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {family: save_hf_model(make_hf_model(family, seed=3), str(root / family)) for family in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_int8_tokens_equal_the_dequantized_reference(hf_dirs, family):
    """Per family (cache layouts alternating): the int8 engine's greedy tokens are those of an
    engine running the dequantized weights in f32, whose matmuls do the same arithmetic."""
    kv_cache = "paged" if sorted(FAMILIES).index(family) % 2 else "slots"
    model = load_model(hf_dirs[family])
    llm = LLM(model, num_slots=4, max_seq_len=64, kv_cache=kv_cache, page_size=8, quantization="int8")
    assert quant.quantization_of(engine_of(llm).params) == "int8"
    from cbjax.runtime.cpu import kernels as cpu_kernels

    assert (engine_of(llm).ops is cpu_kernels.CPU_KERNELS) == cpu_kernels.available()  # the int8 kernel decodes
    reference = LLM(dequantized(dataclasses.replace(model, params=engine_of(llm).params)), num_slots=4, max_seq_len=64,
                    kv_cache=kv_cache, page_size=8, cpu_kernels="off")
    assert tokens(llm) == tokens(reference)


def test_cpu_int8_kernel_matches_the_dequantized_product():
    """The C++ int8 kernel (each 32 weights scaled by their group's scale) against
    x @ dequantized.T: groups of 32, 64 and 128 inputs, one row, odd row counts and the most rows
    it takes, an odd number of weight rows; what it does not take stays with XLA."""
    from cbjax.runtime.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.build_error())
    rng = np.random.default_rng(4)
    product = jax.jit(cpu_kernels.matmul_int8)
    for width, group in ((96, 32), (192, 64), (384, 128), (160, 32)):  # 160: 5 blocks, the last alone
        w = quant.quantize(jnp.asarray(rng.normal(size=(37, width)), jnp.float32), "int8")
        assert w.values.shape[1] // w.scale.shape[1] == group
        dense = np.asarray(w.dequantize())
        for rows, transposed in itertools.product((1, 3, 30, cpu_kernels.MAX_ROWS), (False, True)):
            x = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
            assert cpu_kernels.int8_fits(x, w)
            with cpu_kernels.pinned_form(transposed):  # widened rows against x or against its transpose
                got = np.asarray(product(x, w))
            np.testing.assert_allclose(got, np.asarray(x) @ dense.T, rtol=1e-5, atol=1e-4)
        assert not cpu_kernels.int8_fits(jnp.zeros((cpu_kernels.MAX_ROWS + 1, width)), w)
    one_group = quant.quantize(jnp.ones((4, 48)), "int8")  # 48 inputs: one group of 48, not whole blocks
    assert not cpu_kernels.int8_fits(jnp.ones((1, 48)), one_group)


def logits(model, prompt):
    cache = SlotCache.init(model.config, 1, 32, jnp.float32)
    out, _ = forward(model.params, model.config, cache, jnp.asarray([prompt], jnp.int32), jnp.zeros((1,), jnp.int32))
    return np.asarray(out[0])


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_logits_stay_near_the_model(mode):
    """Quantization moves a tiny model's logits by a small fraction of their spread (fp8 runs
    here through the same widened dot; the engine refuses it only for want of fp8 dots)."""
    model = load_model("tiny-llama")
    q = dataclasses.replace(model, params=quant.quantize_params(model.params, mode, model.config.tie_embeddings))
    want, got = logits(model, PROMPTS[2]), logits(q, PROMPTS[2])
    error = np.abs(got - want).max() / (want.max() - want.min())
    assert error < (0.02 if mode == "int8" else 0.08), error
    assert 0 < error


def test_quantize_groups_and_bytes():
    w = jax.random.normal(jax.random.key(0), (48, 192), jnp.float32)
    q = quant.quantize(w, "int8")
    assert q.values.dtype == jnp.int8 and q.scale.shape == (48, 192 // 64)  # 128 does not divide 192
    assert np.abs(np.asarray(q.dequantize()) - np.asarray(w)).max() <= np.asarray(q.scale).max() / 2 + 1e-6
    assert quant.quantize(w[:, :50], "int8").scale.shape == (48, 1)  # no group size divides 50: one per row
    zero = quant.quantize(jnp.zeros((4, 64)), "int8")
    assert np.all(np.asarray(zero.scale) == 1) and np.all(np.asarray(zero.values) == 0)
    model = load_model("tiny-llama")
    params = quant.quantize_params(model.params, "int8", model.config.tie_embeddings)
    names = quant.MATRICES + (("embed",) if model.config.tie_embeddings else ())
    expected = 0  # every matrix at one byte a weight and 4 per group scale; the rest in f32 as it was
    for name, (out_dim, in_dim) in ((n, s) for n, s in _flat_shapes(model).items()):
        quantized = name.rsplit("/", 1)[-1] in names
        expected += (out_dim * in_dim + 4 * out_dim * in_dim // quant.group_size(in_dim) if quantized
                     else 4 * out_dim * in_dim)
    assert quant.weight_bytes(params) == expected < quant.weight_bytes(model.params) / 2


def _flat_shapes(model):
    from cbjax.models.params import flatten_shapes, param_shapes

    return {n: (s + (1,))[:2] for n, s in flatten_shapes(param_shapes(model.config)).items()}


def test_tensor_parallel_int8_matches_one_device():
    model = load_model("tiny-llama")
    one = LLM(model, num_slots=4, max_seq_len=64, quantization="int8", cpu_kernels="off")
    two = LLM(model, num_slots=4, max_seq_len=64, quantization="int8", tensor_parallel=2)
    scale = engine_of(two).params["layers"][0]["wo"].scale  # a row-split matrix: scales split by input groups
    assert len(scale.sharding.device_set) == 2
    assert tokens(one) == tokens(two)


def test_orbax_round_trip_keeps_quantized_weights(tmp_path):
    model = load_model("tiny-qwen3")
    q = dataclasses.replace(model, params=quant.quantize_params(model.params, "int8", model.config.tie_embeddings))
    save_orbax(q, str(tmp_path / "q"))
    back = load_orbax(str(tmp_path / "q"))
    assert quant.quantization_of(back.params) == "int8"
    assert jax.tree.structure(back.params) == jax.tree.structure(q.params)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(q.params)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    llm = LLM(str(tmp_path / "q"), num_slots=4, max_seq_len=64, quantization="int8")
    assert tokens(llm) == tokens(LLM(q, num_slots=4, max_seq_len=64))


def test_bad_quantization_settings():
    from types import SimpleNamespace

    from cbjax.core.builder import quantized

    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM("tiny-llama", quantization="int4")
    if quant.fp8_refusal(jax.devices()[0]) is not None:
        with pytest.raises(ValueError, match="quantization='fp8' needs .*fp8 dots"):
            LLM("tiny-llama", quantization="fp8")
    with pytest.raises(ValueError, match="quantization="):
        quant.quantize_params({"layers": []}, "q4", False)
    hopper = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100")
    ampere = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")
    assert quant.fp8_refusal(hopper) is None
    assert "compute capability 8.9+" in quant.fp8_refusal(ampere) and "8.0" in quant.fp8_refusal(ampere)
    model = load_model("tiny-llama")
    int8 = quantized(model, "int8", jax.devices()[0])
    assert quant.quantization_of(quantized(int8, "int8", jax.devices()[0]).params) == "int8"
    with pytest.raises(ValueError, match="already int8-quantized"):
        quantized(int8, "fp8", hopper)


# ---------------------------------------------------------------- the KV cache in 8 bits
@pytest.mark.parametrize("family", sweep(sorted(FAMILIES), quick={"llama"}))
def test_int8_kv_tokens_agree_across_layouts_and_attention(hf_dirs, family):
    """Per family: int8 KV gives the same greedy tokens in the slot and the paged cache and by
    the reference path and the ragged kernel (interpreted); fp8 KV in the slot cache runs too.
    Every cache layer is 8-bit values with their scales."""
    from cbjax.models.kv_cache import QuantizedKV

    model = load_model(hf_dirs[family])
    runs = {}
    for kv_cache, attention in (("slots", "reference"), ("paged", "reference"), ("paged", "pallas")):
        llm = LLM(model, num_slots=4, max_seq_len=64, kv_cache=kv_cache, page_size=16, attention=attention,
                  kv_cache_dtype="int8")
        assert all(isinstance(layer, QuantizedKV) and layer.dtype == jnp.int8 for layer in engine_of(llm).cache.k)
        runs[kv_cache, attention] = tokens(llm)
    assert len({str(r) for r in runs.values()}) == 1, runs
    fp8 = LLM(model, num_slots=4, max_seq_len=64, kv_cache_dtype="fp8")
    assert engine_of(fp8).cache.v[0].dtype == jnp.float8_e4m3fn and len(tokens(fp8)) == len(PROMPTS)


def decode_logits(llm: LLM, prompt, steps: int = 6) -> np.ndarray:
    out = llm.generate([prompt], SamplingParams(max_tokens=steps, ignore_eos=True, logprobs=5), use_tqdm=False)[0]
    return np.asarray([[logprob for _, logprob in step.top] for step in out.logprobs])


def test_int8_kv_keeps_decode_logprobs_near_full_precision():
    """The same model decoding its greedy tokens: top-5 logprobs with an int8 KV cache within a
    small distance of the f32 cache's (history read back dequantized in every step)."""
    model = load_model("tiny-qwen3")
    prompt = list(range(5, 40))
    full = decode_logits(LLM(model, num_slots=2, max_seq_len=64), prompt)
    int8 = decode_logits(LLM(model, num_slots=2, max_seq_len=64, kv_cache_dtype="int8"), prompt)
    assert np.abs(int8 - full).max() < 0.05


@pytest.mark.parametrize("head_dim", [64, 80])
def test_kv_rotation_is_orthonormal_and_spreads_the_error(head_dim):
    """The 8-bit cache's rotation is orthonormal (Hadamard for a power of two: symmetric), and on
    keys with a few large channels it shrinks the error of q.k through fp8 and int8 storage."""
    from cbjax.models.kv_cache import QuantizedKV, decode, encode, kv_rotation, rotate

    r = kv_rotation(head_dim)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-5)
    if head_dim == 64:
        np.testing.assert_allclose(r, r.T)
        assert np.allclose(np.abs(r), head_dim ** -0.5)
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((4096, head_dim)).astype(np.float32)
    keys[:, :4] *= 12.0  # RoPE'd keys carry most of their magnitude in a few channels
    queries = rng.standard_normal((4096, head_dim)).astype(np.float32)
    queries[:, :4] *= 3.0
    exact = np.sum(keys * queries, axis=-1)
    for dtype in (jnp.float8_e4m3fn, jnp.int8):
        like = QuantizedKV(jnp.zeros((1,), dtype), jnp.zeros((1,), jnp.float32))
        plain = np.sum(np.asarray(decode(encode(jnp.asarray(keys), like))) * queries, axis=-1)
        stored = decode(encode(rotate(jnp.asarray(keys), head_dim), like))
        rotated = np.sum(np.asarray(stored) * np.asarray(rotate(jnp.asarray(queries), head_dim)), axis=-1)
        assert np.abs(rotated - exact).mean() < 0.85 * np.abs(plain - exact).mean(), dtype  # measured 0.38-0.78
        np.testing.assert_allclose(np.asarray(rotate(rotate(jnp.asarray(keys), head_dim), head_dim, back=True)),
                                   keys, atol=1e-4)


def test_8bit_cache_gives_back_the_models_keys():
    """The 8-bit cache stores rotated vectors; `get_sequence` rotates them back: the keys and
    values the f32 cache holds after the same prefill, to 8-bit precision."""
    from cbjax.models.kv_cache import SlotCache
    from cbjax.models.transformer import forward

    model = load_model("tiny-llama")
    tokens = jnp.asarray([list(range(5, 30))], jnp.int32)
    held = {}
    # One program per cache dtype (op by op, the prefill compiled ~130 small programs).
    prefill = jax.jit(lambda params, cache: forward(params, model.config, cache, tokens, jnp.zeros((1,), jnp.int32),
                                                    slot_ids=jnp.zeros((1,), jnp.int32), kv_len=0)[1])
    for dtype in (jnp.float32, jnp.int8, jnp.float8_e4m3fn):
        cache = prefill(model.params, SlotCache.init(model.config, 2, 64, dtype))
        held[jnp.dtype(dtype).name] = [np.asarray(a) for a in cache.get_sequence(0)]
    for name, tolerance in (("int8", 0.02), ("float8_e4m3fn", 0.07)):
        for got, want in zip(held[name], held["float32"]):
            assert got.shape == want.shape == (model.config.num_layers, model.config.num_kv_heads, 25,
                                               model.config.head_dim)
            assert np.abs(got - want).max() <= tolerance * np.abs(want).max(), name


def test_kv_bytes_budget_holds_about_twice_the_bf16_sequences():
    from cbjax.models.kv_cache import SlotCache

    model = load_model("tiny-llama", dtype="bfloat16")
    config, hd = model.config, model.config.head_dim
    assert (SlotCache.bytes_per_slot(config, 64, jnp.int8) * (2 * hd)
            == SlotCache.bytes_per_slot(config, 64, jnp.bfloat16) * (hd + 4))
    budget = 8 * SlotCache.bytes_per_slot(config, 64, jnp.bfloat16)
    bf16 = LLM(model, dtype="bfloat16", max_seq_len=64, kv_cache_bytes=budget)
    int8 = LLM(model, dtype="bfloat16", max_seq_len=64, kv_cache_bytes=budget, kv_cache_dtype="int8")
    assert engine_of(bf16).num_slots == 8 and engine_of(int8).num_slots == 8 * 2 * hd // (hd + 4)
    paged = LLM(model, dtype="bfloat16", max_seq_len=64, kv_cache="paged", page_size=16, kv_cache_bytes=budget,
                kv_cache_dtype="int8")
    assert engine_of(paged).config.num_pages == budget // SlotCache.bytes_per_slot(config, 16, jnp.int8)
    held = sum(a.nbytes for a in jax.tree.leaves((engine_of(paged).cache.k, engine_of(paged).cache.v)))
    assert held <= budget
    # f32 weights with a float16 cache (no scales): exactly twice the f32 cache's sequences.
    f32 = LLM("tiny-llama", max_seq_len=64, kv_cache_bytes=budget)
    f16 = LLM("tiny-llama", max_seq_len=64, kv_cache_bytes=budget, kv_cache_dtype="float16")
    assert engine_of(f16).num_slots == 2 * engine_of(f32).num_slots == 8


def test_int8_kv_pages_and_swaps_through_the_host_tier():
    """Paged int8 KV with prefix caching, a host tier and swap preemption: pages evicted to the
    host and loaded back and sequences swapped out and in carry their scales, and the outputs
    equal the same engine's without a host tier (recompute)."""
    model = load_model("tiny-llama")
    rng = np.random.default_rng(4)
    shared = rng.integers(3, 500, 24).tolist()
    prompts = [shared + rng.integers(3, 500, int(n)).tolist() for n in rng.integers(2, 9, 10)]
    args = dict(num_slots=3, max_seq_len=64, kv_cache="paged", page_size=16, num_pages=9,
                enable_prefix_caching=True, kv_cache_dtype="int8")
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in LLM(model, **args).generate(prompts, sampling, use_tqdm=False)]
    llm = LLM(model, **args, host_kv_cache_bytes=1 << 22, preemption_mode="swap")
    got = [o.token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)]
    assert got == want
    stats = scheduler_of(llm).host.stats
    assert stats.pages_out > 0 and engine_of(llm).host_kv.stored_bytes == scheduler_of(llm).host.used


def test_bad_kv_cache_dtype_settings():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM("tiny-llama", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="page_size a power of two >= 16 for int8 KV"):
        LLM("tiny-llama", max_seq_len=64, kv_cache="paged", page_size=8, attention="pallas", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' stores float16 under float32 activations"):
        LLM("tiny-llama", max_seq_len=64, kv_cache="paged", page_size=16, attention="pallas", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' runs on a device"):
        LLM("tiny-llama", kv_cache_dtype="int8", simulate="h100")


@slow
def test_int8_kv_across_scale_out():
    """int8 KV gives one engine's tokens tensor-parallel (scales sharded with the KV heads), over
    two pipeline stages and across disaggregated prefill and decode instances (scales moved)."""
    model = load_model("tiny-llama")
    args = dict(num_slots=2, max_seq_len=64, kv_cache_dtype="int8")
    want = tokens(LLM(model, **args))
    assert tokens(LLM(model, **args, tensor_parallel=2)) == want
    assert tokens(LLM(model, **args, pipeline_stages=2)) == want
    assert tokens(LLM(model, **args, prefill_instances=1, decode_instances=1)) == want
