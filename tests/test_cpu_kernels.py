"""The CPU kernels (cbjax/runtime/cpu_kernels.cc) against the pure-JAX code they replace."""

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
from cbjax.runtime import cpu_kernels
from cbjax.models.attention import attention_part, visible
from cbjax.models.kv_cache import PagedCache, SlotCache
from cbjax.runtime.engine import EngineConfig

# Skipped only where no C++ compiler is installed: where one is, the kernels must build
# (test_the_kernels_build_where_a_compiler_is fails otherwise, never skips).
needs_kernels = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                   reason="no C++ compiler: cpu_kernels='auto' runs through XLA here")


@needs_kernels
def test_the_kernels_build_where_a_compiler_is():
    assert cpu_kernels.available(), cpu_kernels.build_error()
    llm = LLM("tiny-llama", num_slots=2, max_seq_len=32)  # cpu_kernels="auto", f32, one CPU device
    assert llm.engine.ops == cpu_kernels.CPU_KERNELS


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


def test_matmul_fits_only_decode_sized_f32():
    w = jnp.zeros((8, 16), jnp.float32)
    assert not cpu_kernels.fits(jnp.zeros((cpu_kernels.MAX_ROWS + 1, 16), jnp.float32), w)
    assert not cpu_kernels.fits(jnp.zeros((2, 16), jnp.bfloat16), w.astype(jnp.bfloat16))
    assert not cpu_kernels.fits(jnp.zeros((0, 16), jnp.float32), w)


def _history_reference(q, cache, layer_k, layer_v, slot_ids, lo, hi, kv_len):
    keys = cache.read(layer_k, slot_ids, kv_len, False)
    values = cache.read(layer_v, slot_ids, kv_len, False)
    k_pos = jnp.arange(kv_len)[None, None, :]
    mask = (k_pos >= lo[:, None, None]) & (k_pos < hi[:, None, None])
    return attention_part(q, keys, values, mask, q.shape[-1] ** -0.5)


@needs_kernels
@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (6, 1, 20), (4, 2, 8)])
def test_history_attention_equals_reference(layout, q_heads, kv_heads, head_dim):
    rng = np.random.default_rng(q_heads * 100 + head_dim)
    slots, max_len, page_size, rows = 5, 48, 8, 7
    num_pages = slots * max_len // page_size + 3
    shape = (slots, kv_heads, max_len, head_dim) if layout == "slots" else (kv_heads, num_pages, page_size, head_dim)
    layer_k = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    layer_v = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
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
def test_greedy_outputs_equal_with_kernels_on_and_off():
    prompts = [[5, 9, 2, 7], [11, 3], list(range(3, 30))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for choice in ("on", "off"):
        for kv in ("slots", "paged"):
            llm = LLM("tiny-llama", num_slots=2, max_seq_len=64, cpu_kernels=choice, kv_cache=kv, page_size=8,
                      merge_mode="chunked", max_num_batched_tokens=9)
            assert llm.engine.ops == (cpu_kernels.CPU_KERNELS if choice == "on" else XLA)
            outs[choice, kv] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["on", "slots"] == outs["off", "slots"] == outs["on", "paged"] == outs["off", "paged"]


def test_without_a_compiler_the_engine_runs_through_xla(tmp_path):
    code = ("from cbjax import LLM, SamplingParams\n"
            "from cbjax.models.ops import XLA\n"
            "from cbjax.runtime import cpu_kernels\n"
            "llm = LLM('tiny-llama', num_slots=2, max_seq_len=32)\n"
            "assert llm.engine.ops == XLA\n"
            "assert 'no C++ compiler' in cpu_kernels.build_error(), cpu_kernels.build_error()\n"
            "print(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids)\n")
    env = {**os.environ, "CXX": "no-such-compiler", "CBJAX_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(eval(done.stdout.strip().splitlines()[-1])) == 4


STRESS = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from cbjax.runtime import cpu_kernels
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


@needs_kernels
def test_thread_pool_survives_back_to_back_calls_of_different_chunk_counts():
    """Matmuls of different chunk counts, dispatched back to back. The pool once let a worker
    that had seen one job's last ticket claim a chunk of the next job, which pushed the
    next job's done count past its chunk count and spun its caller forever (the main job
    hung in MatmulNT); this loop hung within seconds then. A hang fails on the timeout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", STRESS, "10"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
