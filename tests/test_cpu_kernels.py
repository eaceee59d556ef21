"""The CPU kernels (cbjax/runtime/cpu/) against the pure-JAX code they replace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.models.ops import XLA
from cbjax.runtime.cpu import kernels as cpu_kernels
from cbjax.models.attention import attention_part, visible
from cbjax.models.kv_cache import PagedCache, SlotCache
from cbjax.runtime.engine import EngineConfig
from tests.tiers import slow
from tests.internals import engine_of

# Skipped only where no C++ compiler is installed: where one is, the kernels must build
# (test_the_kernels_build_where_a_compiler_is fails otherwise, never skips).
needs_kernels = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                   reason="no C++ compiler: cpu_kernels='auto' runs through XLA here")


@needs_kernels
def test_the_kernels_build_where_a_compiler_is():
    assert cpu_kernels.available(), cpu_kernels.build_error()
    llm = LLM("tiny-llama", num_slots=2, max_seq_len=32)  # cpu_kernels="auto", f32, one CPU device
    assert engine_of(llm).ops == cpu_kernels.CPU_KERNELS


@needs_kernels
@pytest.mark.parametrize("lead", [(1,), (3,), (5, 1), (8, 1), (2, 8), (37,)])
@pytest.mark.parametrize("n,k", [(1, 16), (5, 24), (64, 576), (130, 40), (7, 3)])
def test_matmul_equals_einsum(lead, n, k):
    rng = np.random.default_rng(n * 1000 + k + sum(lead))
    x = jnp.asarray(rng.standard_normal(lead + (k,), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32))
    assert cpu_kernels.fits(x, w) == (x.size // k <= cpu_kernels.MAX_ROWS)
    got = jax.jit(cpu_kernels.matmul_nt)(x, w)
    want = jnp.einsum("...d,od->...o", x, w, precision="highest")
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * np.sqrt(k))


@needs_kernels
@pytest.mark.parametrize("rows", [2, 9, 16, 17, 31, 33, 48, 63, 64])
@pytest.mark.parametrize("n,k", [(130, 40), (72, 576), (5, 7)])
def test_matmul_forms_agree(rows, n, k):
    """Both f32 forms (matmul.h: the dot-product tiles and the transposed input) equal einsum at
    every row count, whole tiles and tails, whichever the timing (crossover.h) picked; the
    choices it made, over counts 2 to MAX_ROWS only, come back after a pinned block."""
    rng = np.random.default_rng(rows * 100 + n)
    x = jnp.asarray(rng.standard_normal((rows, k), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32))
    want = np.asarray(jnp.einsum("md,od->mo", x, w, precision="highest"))
    measured = {kind: cpu_kernels.transposed_rows(kind) for kind in cpu_kernels.MATMUL_KINDS}
    assert all(set(m) <= set(range(2, cpu_kernels.MAX_ROWS + 1)) for m in measured.values())
    for transposed in (False, True):
        with cpu_kernels.pinned_form(transposed):
            assert cpu_kernels.transposed_rows("int8") == (list(range(2, cpu_kernels.MAX_ROWS + 1)) if transposed else [])
            got = jax.jit(cpu_kernels.matmul_nt)(x, w)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.sqrt(k), err_msg=str(transposed))
    assert {kind: cpu_kernels.transposed_rows(kind) for kind in cpu_kernels.MATMUL_KINDS} == measured


@needs_kernels
def test_the_crossover_is_measured_per_kind():
    """measure_crossover times a kind's two forms again (a width that is not whole 32-blocks is
    refused) and the matmuls of that kind follow what it set."""
    with cpu_kernels.pinned_form(False):
        for kind in cpu_kernels.MATMUL_KINDS:
            rows = cpu_kernels.measure_crossover(kind, 64)
            assert rows == cpu_kernels.transposed_rows(kind) and set(rows) <= set(range(2, cpu_kernels.MAX_ROWS + 1))
        with pytest.raises(ValueError, match="multiple of 32"):
            cpu_kernels.measure_crossover("Q4_1", 40)


@needs_kernels
@pytest.mark.parametrize("n,threads", [(1, 1), (127, 2), (128 * 40 + 3, 3), (1 << 16, 2)])
def test_the_roofline_read_loop_reads_every_float_once(n, threads):
    """bandwidth.h's read loop (the CPU roofline's memory side) sums each part of the buffer
    once, remainders included, whatever the thread count."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    assert cpu_kernels.read_sum(x, threads) == pytest.approx(float(x.astype(np.float64).sum()), abs=1e-3 * n ** 0.5)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.read_sum(x.astype(np.float64), threads)


@needs_kernels
def test_the_roofline_gemm_rate_is_a_rate():
    """bandwidth.h's compute side: a positive GFLOP/s for each form's row counts; nonsense refused."""
    for rows in (1, 8, 33):
        assert cpu_kernels.matmul_gflops(rows, 64, 2, seconds=0.002) > 0
    with pytest.raises(ValueError, match="positive"):
        cpu_kernels.matmul_gflops(0, 64, 1)


def test_matmul_fits_only_decode_sized_f32():
    w = jnp.zeros((8, 16), jnp.float32)
    assert not cpu_kernels.fits(jnp.zeros((cpu_kernels.MAX_ROWS + 1, 16), jnp.float32), w)
    assert not cpu_kernels.fits(jnp.zeros((2, 16), jnp.bfloat16), w.astype(jnp.bfloat16))
    assert not cpu_kernels.fits(jnp.zeros((0, 16), jnp.float32), w)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 49152), (3, 1000), (2, 5, 37), (7,), (1, 1)])
def test_argmax_equals_jnp_argmax(shape):
    """First maximum, ties and signed zeros included; the first NaN where a row has one; -inf rows."""
    rng = np.random.default_rng(sum(shape))
    x = rng.integers(-4, 5, shape).astype(np.float32)  # small integers: many ties
    flat = x.reshape(-1, shape[-1])
    flat[0, -1] = 9.0  # the maximum in the scalar tail
    if flat.shape[0] > 1:
        flat[1, :] = -np.inf
    if flat.shape[0] > 2:
        flat[2, [shape[-1] // 2, shape[-1] - 1]] = np.nan
        flat[-1, :] = 0.0
        flat[-1, 1::2] = -0.0
    got = np.asarray(jax.jit(cpu_kernels.CPU_KERNELS.argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32 and got.shape == shape[:-1]
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got, np.asarray(XLA.argmax(jnp.asarray(x))))


def _history_reference(q, cache, layer_k, layer_v, slot_ids, lo, hi, kv_len):
    keys = cache.read(layer_k, slot_ids, kv_len, False)
    values = cache.read(layer_v, slot_ids, kv_len, False)
    k_pos = jnp.arange(kv_len)[None, None, :]
    mask = (k_pos >= lo[:, None, None]) & (k_pos < hi[:, None, None])
    return attention_part(q, keys, values, mask, q.shape[-1] ** -0.5)


@needs_kernels
@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (6, 1, 20), (4, 2, 8)])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_history_attention_equals_reference(layout, q_heads, kv_heads, head_dim, cache_dtype):
    rng = np.random.default_rng(q_heads * 100 + head_dim)
    slots, max_len, page_size, rows = 5, 48, 8, 7
    num_pages = slots * max_len // page_size + 3
    shape = (kv_heads, slots, max_len, head_dim) if layout == "slots" else (kv_heads, num_pages, page_size, head_dim)
    layer_k = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), cache_dtype)
    layer_v = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), cache_dtype)
    lengths = jnp.zeros((slots,), jnp.int32)
    if layout == "slots":
        cache = SlotCache(k=(layer_k,), v=(layer_v,), lengths=lengths)
    else:  # a slot's pages scattered over the pool
        tables = rng.permutation(num_pages)[:slots * max_len // page_size].reshape(slots, -1)
        cache = PagedCache(k=(layer_k,), v=(layer_v,), block_tables=jnp.asarray(tables, jnp.int32), lengths=lengths)
    q = jnp.asarray(rng.standard_normal((rows, 1, q_heads, head_dim), dtype=np.float32))
    slot_ids = jnp.asarray(rng.integers(0, slots, rows), jnp.int32)
    kv_len = 40
    # Empty rows (hi <= lo), a window's lower bound, a row reaching kv_len.
    lo = jnp.asarray([0, 0, 5, 12, 3, 0, 30], jnp.int32)
    hi = jnp.asarray([1, 0, 17, 12, 40, 33, 39], jnp.int32)
    got = jax.jit(cpu_kernels.history_attention)(q, cache, layer_k, layer_v, slot_ids, lo, hi)
    want = _history_reference(q, cache, layer_k, layer_v, slot_ids, lo, hi, kv_len)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_history_attention_window_bounds_match_visible():
    """lo/hi as the transformer derives them equal the reference mask of a sliding window."""
    pos = jnp.arange(0, 40, 3, dtype=jnp.int32)
    window = 7
    lo = jnp.maximum(pos - window + 1, 0)
    k_pos = jnp.arange(40)[None, :]
    mask = visible(pos[:, None], k_pos, window) & (k_pos < pos[:, None])
    assert bool(jnp.all(mask == ((k_pos >= lo[:, None]) & (k_pos < pos[:, None]))))


def test_engine_config_checks_cpu_kernels():
    with pytest.raises(ValueError, match="cpu_kernels"):
        EngineConfig(cpu_kernels="maybe")


def test_cpu_kernels_on_refuses_what_they_cannot_run():
    with pytest.raises(ValueError, match="cpu_kernels='on' is unavailable: the weights are bfloat16"):
        LLM("tiny-llama", num_slots=2, max_seq_len=32, dtype="bfloat16", cpu_kernels="on")


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["auto", "float16"])
def test_greedy_outputs_equal_with_kernels_on_and_off(kv_dtype):
    """Slots and pages, f32 weights with the cache in f32 (auto) or f16 (half the bytes; the
    layer kernel takes every layer by address either way)."""
    prompts = [[5, 9, 2, 7], [11, 3], list(range(3, 30))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for choice in ("on", "off"):
        for kv in ("slots", "paged"):
            llm = LLM("tiny-llama", num_slots=2, max_seq_len=64, cpu_kernels=choice, kv_cache=kv, page_size=8,
                      merge_mode="chunked", max_num_batched_tokens=9, kv_cache_dtype=kv_dtype)
            assert engine_of(llm).ops == (cpu_kernels.CPU_KERNELS if choice == "on" else XLA)
            want = jnp.float16 if kv_dtype == "float16" else jnp.float32
            assert all(a.dtype == want for a in engine_of(llm).cache.k + engine_of(llm).cache.v)
            assert (engine_of(llm)._params_by_address is not None) == (choice == "on")
            outs[choice, kv] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["on", "slots"] == outs["off", "slots"] == outs["on", "paged"] == outs["off", "paged"]


def test_without_a_compiler_the_engine_runs_through_xla(tmp_path):
    code = ("from cbjax import LLM, SamplingParams\n"
            "from cbjax.models.ops import XLA\n"
            "from cbjax.runtime.cpu import kernels as cpu_kernels\n"
            "from tests.internals import engine_of\n"
            "llm = LLM('tiny-llama', num_slots=2, max_seq_len=32)\n"
            "assert engine_of(llm).ops == XLA\n"
            "assert 'no C++ compiler' in cpu_kernels.build_error(), cpu_kernels.build_error()\n"
            "print(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids)\n")
    env = {**os.environ, "CXX": "no-such-compiler", "CBJAX_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(eval(done.stdout.strip().splitlines()[-1])) == 4


STRESS = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from cbjax.runtime.cpu import kernels as cpu_kernels
calls = []
for m, k, n in [(1, 576, 1536), (3, 576, 64), (8, 1536, 576), (2, 64, 4096), (1, 576, 20000)]:
    x, w = jnp.ones((m, k)), jnp.full((n, k), 0.01)
    f = jax.jit(cpu_kernels.matmul_nt)
    f(x, w).block_until_ready()
    calls.append((f, x, w))
rng = np.random.default_rng(0)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    jax.block_until_ready([f(x, w) for f, x, w in (calls[j] for j in rng.integers(0, len(calls), size=8))])
print("ok")
"""


@slow
@needs_kernels
def test_thread_pool_survives_back_to_back_calls_of_different_chunk_counts():
    """Matmuls of different chunk counts, dispatched back to back. The pool once let a worker
    that had seen one job's last ticket claim a chunk of the next job, which pushed the
    next job's done count past its chunk count and spun its caller forever (the main job
    hung in MatmulNT); this loop hung within seconds then. A hang fails on the timeout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", STRESS, "10"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _layer_config(family: str):
    import dataclasses

    from cbjax.loading.presets import RANDOM_PRESETS

    config = RANDOM_PRESETS["tiny-qwen3" if family == "qwen3" else "tiny-llama"]
    if family == "window":  # Mistral's sliding window on the first layer, full attention on the second
        config = dataclasses.replace(config, model_type="mistral", sliding_windows=(5, 0))
    if family == "llama3":
        config = dataclasses.replace(config, num_kv_heads=1, rope_scaling=(
            ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 16), ("rope_type", "llama3")))
    return config


def _mixed_step(config, params, layout, cache_dtype=jnp.float32):
    """A cache (of `cache_dtype`) holding three slots' prompts and a flat batch of one-token rows
    as the mixed step makes it: decode rows, three tokens of one sequence (they see each other's
    new keys), a padding row and a row past its slot's room (dropped). Returns (cache,
    step(ops, params, cache), num_valid)."""
    from cbjax.models.transformer import forward

    slots, max_len, page_size = 3, 32, 4
    if layout == "slots":
        cache = SlotCache.init(config, slots, max_len, cache_dtype)
    else:  # each slot's pages scattered over the pool
        num_pages = slots * max_len // page_size + 2
        tables = np.random.default_rng(0).permutation(num_pages)[:slots * max_len // page_size]
        cache = PagedCache.init(config, slots, max_len, num_pages, page_size, cache_dtype)
        cache = PagedCache(k=cache.k, v=cache.v, block_tables=jnp.asarray(tables.reshape(slots, -1), jnp.int32),
                           lengths=cache.lengths)
    rng = np.random.default_rng(1)
    history = [9, 14, 31]  # tokens each slot holds before the step
    prefill = jax.jit(lambda params, cache, tokens, slot: forward(  # one program a prompt, not one an op
        params, config, cache, tokens, jnp.zeros((1,), jnp.int32), slot_ids=slot, kv_len=max_len)[1])
    for slot, n in enumerate(history):  # prompts through the reference (T > 1: never the kernel)
        tokens = jnp.asarray(rng.integers(3, config.vocab_size, (1, n)), jnp.int32)
        cache = prefill(params, cache, tokens, jnp.asarray([slot], jnp.int32))
    # Rows: slot 0 decodes; slot 1 takes three tokens; padding; slot 2 at 31 decodes (its
    # last position) and a token at 32 that has no room (dropped, as the reference drops it).
    slot_ids = jnp.asarray([0, 1, 1, 1, 0, 2, 2], jnp.int32)
    starts = jnp.asarray([9, 14, 15, 16, 0, 31, 32], jnp.int32)
    num_valid = jnp.asarray([1, 1, 1, 1, 0, 1, 1], jnp.int32)
    flat_rows = jnp.asarray([0, 1, 1, 1, 7, 2, 3], jnp.int32)
    history_end = jnp.asarray([9, 14, 14, 14, 0, 31, 32], jnp.int32)
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, (7, 1)), jnp.int32)

    def step(ops, params, cache):
        return forward(params, config, cache, tokens, starts, num_valid=num_valid, slot_ids=slot_ids,
                       kv_len=max_len, flat_rows=flat_rows, history_end=history_end,
                       logits_rows=jnp.arange(7), ops=ops)

    return cache, step, num_valid


@needs_kernels
@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "window", "llama3"])
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.float16])
def test_decoder_layer_equals_the_layer_op_by_op(layout, family, cache_dtype):
    """The whole-layer kernel against the transformer's layer op by op (XLA) on a flat batch of
    one-token rows as the mixed step makes it: decode rows, three tokens of one sequence (they
    see each other's new keys), a padding row and a row past its slot's room (dropped); an f32
    cache, or an f16 one (kv_cache_dtype float16: written rounded as XLA rounds, read widened)."""
    from cbjax.models.params import init_params

    config = _layer_config(family)
    params = init_params(config, seed=3, std=0.2)
    cache, step, num_valid = _mixed_step(config, params, layout, cache_dtype)
    lowered = jax.jit(step, static_argnums=0).lower(cpu_kernels.CPU_KERNELS, params, cache).as_text()
    assert lowered.count("cbjax_decoder_layer") == config.num_layers
    got_logits, got = jax.jit(step, static_argnums=0)(cpu_kernels.CPU_KERNELS, params, cache)
    want_logits, want = jax.jit(step, static_argnums=0)(XLA, params, cache)
    # The same layers with their weights named by address: one table argument, the same results.
    by_address = {**params, "layers": cpu_kernels.layer_addresses(params, config)}
    assert len(jax.tree.leaves(by_address)) == len(params) and len(by_address["layers"]) == config.num_layers
    lowered = jax.jit(step, static_argnums=0).lower(cpu_kernels.CPU_KERNELS, by_address, cache).as_text()
    assert lowered.count("cbjax_decoder_layer_at") == config.num_layers
    at_logits, at = jax.jit(step, static_argnums=0)(cpu_kernels.CPU_KERNELS, by_address, cache)
    np.testing.assert_array_equal(np.asarray(at_logits), np.asarray(got_logits))
    for a, g in zip(at.k + at.v, got.k + got.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(g))
    real = np.asarray(num_valid) > 0
    real[-1] = False  # the dropped token attends to nothing written; only its cache write is checked
    np.testing.assert_allclose(np.asarray(got_logits)[real], np.asarray(want_logits)[real], rtol=2e-4, atol=2e-4)
    # Values within 2e-4 before they are written may round to neighbouring f16 values: one
    # step of the cache's dtype more (seen on JAX 0.12, whose XLA fuses the layer differently).
    rtol = 2e-4 + float(jnp.finfo(cache_dtype).eps)
    for g, w in zip(got.k + got.v, want.k + want.v):
        assert g.dtype == w.dtype == cache_dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol, atol=2e-5)


def _quantized_matrix(w, kind: str):
    """`w` as GGUF blocks of `kind`, or quantization='int8' (groups of 32, 64 or 128 inputs)."""
    import gguf

    from cbjax.models import quant
    from cbjax.models.gguf_blocks import GGUFWeight

    if kind == "int8":
        return quant.quantize(w, "int8")
    return GGUFWeight(jnp.asarray(gguf.quants.quantize(np.asarray(w), getattr(gguf.GGMLQuantizationType, kind))), kind)


@needs_kernels
@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("weights", ["gguf", "int8"])
def test_quantized_layers_by_address_equal_the_dequantized_reference(layout, weights):
    """Layers whose matrices are GGUF blocks (Q8_0, Q4_0 and Q4_1 mixed within a layer, as
    k-quant files mix types) or int8 with their groups' scales run as one layer-kernel call
    each, by address, and give the XLA path's results on the same weights (dequantized whole)
    on the mixed step's rows."""
    from cbjax.models.params import init_params

    config = _layer_config("llama")
    params = init_params(config, seed=3, std=0.2)
    kinds = list(cpu_kernels.BLOCK_KINDS) if weights == "gguf" else ["int8"]
    layers = []
    for i, p in enumerate(params["layers"]):
        layer = dict(p)
        for j, name in enumerate(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")):
            layer[name] = _quantized_matrix(p[name], kinds[(i + j) % len(kinds)])
        layers.append(layer)
    blocked = {**params, "layers": layers}
    table = cpu_kernels.layer_addresses(blocked, config)
    assert table is not None  # every matrix quantized
    column = 6 * cpu_kernels.LAYER_WEIGHTS.index("wo") + 2
    kind_ids = {**cpu_kernels.BLOCK_KINDS, "int8": cpu_kernels.INT8_KIND}
    assert [int(k) for k in np.asarray(table.table)[:, column]] == [kind_ids[kinds[(i + 3) % len(kinds)]]
                                                                    for i in range(config.num_layers)]
    cache, step, num_valid = _mixed_step(config, blocked, layout)
    by_address = {**blocked, "layers": table}
    lowered = jax.jit(step, static_argnums=0).lower(cpu_kernels.CPU_KERNELS, by_address, cache).as_text()
    assert lowered.count("cbjax_decoder_layer_at") == config.num_layers
    got_logits, got = jax.jit(step, static_argnums=0)(cpu_kernels.CPU_KERNELS, by_address, cache)
    want_logits, want = jax.jit(step, static_argnums=0)(XLA, blocked, cache)
    real = np.asarray(num_valid) > 0
    real[-1] = False
    np.testing.assert_allclose(np.asarray(got_logits)[real], np.asarray(want_logits)[real], rtol=2e-4, atol=2e-4)
    for g, w in zip(got.k + got.v, want.k + want.v):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)
    one_row = jax.jit(cpu_kernels.CPU_KERNELS.dense)  # and one decode row through a single block matmul
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, config.hidden_size)), jnp.float32)
    for name in ("wq", "w_up"):
        w = layers[0][name]
        np.testing.assert_allclose(np.asarray(one_row(x, w)), np.asarray(x @ w.dequantize().T), rtol=1e-5, atol=1e-4)


@needs_kernels
def test_weights_by_address_only_where_the_layer_kernel_takes_every_layer():
    """`layer_addresses` builds a table only for layers the kernel runs (no biases, f32, on
    the CPU); a program given one refuses rows the kernel does not take instead of reading
    weights it does not have; the engine hands it to its programs of at most MAX_ROWS tokens."""
    from cbjax.models.params import init_params

    config = _layer_config("llama")
    params = init_params(config, seed=3, std=0.2)
    table = cpu_kernels.layer_addresses(params, config)
    rows = np.asarray(table.table)
    assert rows.shape == (config.num_layers, 6 * len(cpu_kernels.LAYER_WEIGHTS))
    wq = params["layers"][1]["wq"].unsafe_buffer_pointer()
    at = 6 * cpu_kernels.LAYER_WEIGHTS.index("wq")
    assert int(rows[1, at]) | int(rows[1, at + 1]) << 32 == wq
    assert (rows[:, 2::6] == cpu_kernels.F32_KIND).all() and not rows[:, 3::6].any()  # no int8 scales
    assert not rows[:, 6 * cpu_kernels.LAYER_WEIGHTS.index("q_norm")].any()  # llama has none

    biased = {**params, "layers": [{**p, "bq": jnp.zeros(p["wq"].shape[0])} for p in params["layers"]]}
    assert cpu_kernels.layer_addresses(biased, config) is None
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    assert cpu_kernels.layer_addresses(half, config) is None

    from types import SimpleNamespace

    from cbjax.runtime.engine import Engine

    engine = Engine(SimpleNamespace(config=config, params=params), EngineConfig(num_slots=2, max_seq_len=64))
    for tokens in engine.token_buckets():
        given = engine.padding_arguments(tokens, 1)[0][0]["layers"]
        assert isinstance(given, cpu_kernels.LayerAddresses) == (tokens <= cpu_kernels.MAX_ROWS), tokens

    cache = SlotCache.init(config, 2, 16)
    x = jnp.zeros((cpu_kernels.MAX_ROWS + 1, 1, config.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="by address"):
        cpu_kernels.CPU_KERNELS.decoder_layer(x, next(iter(table)), config, cache, cache.k[0], cache.v[0],
                                              None, None, None, None, None, 0)
