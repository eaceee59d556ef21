"""The Pallas decode matmul (pallas_kernels/decode_matmul): its body in interpret mode against
the pure-JAX reference for each form, weight format (int8 and fp8 e4m3 with groups of 32, 64 and
128 inputs or one scale a row; bf16 and f32 without scales) and row count; the reference against
the dequantized product; launch names and the tuned choice; the Triton lowering for cuda traced
on this CPU; the shapes it refuses; and an engine running it (EngineConfig.quantized_matmul=
'pallas', interpreted) giving the tokens of XLA's int8 dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib.mlir import ir

from cbjax import LLM, SamplingParams
from cbjax.models import quant
from cbjax.runtime import engine_ops
from pallas_kernels import tuning
from pallas_kernels.decode_matmul import (Launch, candidates, decode_matmul, reference, resolve, shape_of, tuned,
                                          unsupported)
from pallas_kernels.decode_matmul import triton_kernel
from tests.internals import engine_of

FORMS = ("reduce", "stream", "dot")
# (weight dtype, inputs a scale group; 0: one scale a row, None: a float weight without scales)
FORMATS = [(jnp.int8, 32), (jnp.int8, 64), (jnp.int8, 128), (jnp.int8, 0), (jnp.float8_e4m3fn, 32),
           (jnp.float8_e4m3fn, 0), (jnp.bfloat16, None), (jnp.float32, None)]


def normal(shape, seed: int, dtype=jnp.float32, std: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(scale=std, size=shape), dtype)


def weight(out_dim: int, in_dim: int, mode: str, per_row: bool, seed: int = 0) -> quant.QuantizedWeight:
    w = quant.quantize(normal((out_dim, in_dim), seed, std=0.05), mode)
    return quant.QuantizedWeight(w.values, w.scale[:, :1]) if per_row else w


def random_weight(out_dim: int, in_dim: int, dtype, group: int | None, seed: int) -> tuple:
    """`(values, scale)` of any format: 8-bit values over their whole range with a random scale
    per `group` inputs (0: per row), or a float weight and None. Drawn by numpy: a jax.random
    draw outside a jit compiles a program for every new shape."""
    if group is None:
        return normal((out_dim, in_dim), seed, dtype, std=0.05), None
    rng = np.random.default_rng(seed)
    raw = rng.uniform(-127, 127, (out_dim, in_dim)).astype(np.float32)
    values = jnp.asarray(np.round(raw), dtype) if dtype == jnp.int8 else jnp.asarray(raw * (448 / 127), dtype)
    groups = in_dim // group if group else 1
    return values, jnp.asarray(rng.uniform(1e-4, 1e-3, (out_dim, groups)), jnp.float32)


@pytest.mark.parametrize("form,rows", [(f, r) for f in FORMS for r in (1, 3, 16) if f == "dot" or r <= 4])
@pytest.mark.parametrize("dtype,group", FORMATS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_kernel_matches_reference(form, rows, dtype, group):
    values, scale = random_weight(64, 1024, dtype, group, seed=rows)
    x = normal((rows, 1024), 100 + rows)
    want = np.asarray(reference(x, values, scale))
    for launch in (Launch(form=form), Launch(form=form, block_n=16, splits=2, unroll=2)):
        got = np.asarray(decode_matmul(x, values, scale, interpret=True, launch=launch))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


MOSAIC_FORMATS = [(jnp.bfloat16, None), (jnp.float16, None), (jnp.int8, 0), (jnp.float8_e4m3fn, 0)]


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("dtype,group", MOSAIC_FORMATS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_mosaic_form_matches_reference(dtype, group, rows):
    """The Mosaic GPU form under Pallas' GPU interpreter (TMA, shared memory, wgmma simulated):
    bf16/f16 weights and per-output-scaled int8/fp8, 1 and 64 rows, its own blocks and other
    blocks, splits and stages; equal to the reference up to the output's rounding to x's dtype."""
    values, scale = random_weight(128, 512, dtype, group, seed=rows)
    x_dtype = jnp.float16 if dtype == jnp.float16 else jnp.bfloat16
    x = normal((rows, 512), rows, x_dtype)
    want = np.asarray(reference(x, values, scale))
    for launch in (Launch(form="mosaic"), Launch(form="mosaic", block_n=128, splits=2, block_k=64, num_stages=2)):
        got = decode_matmul(x, values, scale, interpret=True, launch=launch)
        assert got.dtype == x_dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=np.abs(want).max() * 2 ** -8)


def test_mosaic_form_refuses_what_it_does_not_take():
    values, scale = random_weight(128, 512, jnp.int8, 64, seed=0)
    x = jnp.ones((2, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="grouped scales stay with the Triton forms"):
        decode_matmul(x, values, scale, interpret=True, launch=Launch(form="mosaic"))
    with pytest.raises(ValueError, match="activations are float32"):
        decode_matmul(x.astype(jnp.float32), values, scale[:, :1], interpret=True, launch=Launch(form="mosaic"))
    assert all(launch.form != "mosaic" for launch in candidates(16, groups=8))
    assert any(launch.form == "mosaic" for launch in candidates(16, groups=1))


def test_reference_is_the_dequantized_product():
    w = weight(48, 256, "int8", per_row=False)
    x = normal((5, 256), 1)
    np.testing.assert_allclose(np.asarray(reference(x, w.values, w.scale)), np.asarray(x @ w.dequantize().T),
                               rtol=1e-5, atol=1e-5)


def test_leading_dims_and_dtype_kept():
    w = weight(32, 128, "int8", per_row=False)
    x = normal((2, 1, 128), 2, jnp.bfloat16)
    y = decode_matmul(x, w.values, w.scale, interpret=True)
    assert y.shape == (2, 1, 32) and y.dtype == jnp.bfloat16
    want = reference(x.reshape(2, 128), w.values, w.scale).reshape(2, 1, 32)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_default_launch_fills_every_program():
    """Llama-3-8B's matrices at one row: the reduce form, whole groups a block, and splits that
    take a 4096-output matrix past 512 programs."""
    form, block_n, block_k, splits, unroll = resolve(Launch(), 1, 4096, 14336, 112)
    assert (form, block_k, unroll) == ("reduce", 128, 1) and (4096 // block_n) * splits >= 512
    assert resolve(Launch(), 16, 14336, 4096, 32)[0] == "dot"
    assert resolve(Launch(), 1, 4096, 4096, 1)[2] == 256  # one scale a row: 256 inputs a block


@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_candidates_are_named_and_fit_every_8b_matrix(rows):
    """Every launch the device would time has a name that reads back as itself, and fits each of
    Llama-3-8B's matrices (a sweep never stops on a shape it cannot launch)."""
    launches = candidates(rows, groups=1)
    assert len({launch.name for launch in launches}) == len(launches) and launches[0] == Launch()
    for launch in launches:
        assert Launch.parse(launch.name) == launch
        for out_dim, in_dim, groups in [(4096, 14336, 112), (14336, 4096, 32), (1024, 4096, 32), (128256, 4096, 32),
                                        (4096, 4096, 0)]:
            form, block_n, block_k, splits, unroll = resolve(launch, rows, out_dim, in_dim, max(groups, 1))
            assert out_dim % block_n == 0 and (in_dim // block_k) % (splits * unroll) == 0


def test_tuned_choice_is_what_a_call_without_launch_runs(monkeypatch):
    """A launch this process's tuning chose for a shape is the one a call with no launch traces;
    "xla" and an untuned shape leave the defaults; other shapes are not affected."""
    seen = []
    original = triton_kernel.matmul
    monkeypatch.setattr(triton_kernel, "matmul", lambda *a, **k: seen.append(k) or original(*a, **k))
    values, scale = random_weight(64, 256, jnp.int8, 32, seed=1)
    x = jnp.ones((2, 256))
    tuning.forget()
    try:
        assert tuned(2, 64, 256, 8, jnp.int8) is None
        tuning.use("decode_matmul", shape_of(2, 64, 256, 8, jnp.int8), Launch(form="stream", block_n=16).name)
        assert tuned(2, 64, 256, 8, jnp.int8) == Launch(form="stream", block_n=16)
        np.testing.assert_allclose(np.asarray(decode_matmul(x, values, scale, interpret=True)),
                                   np.asarray(reference(x, values, scale)), rtol=1e-5)
        assert (seen[-1]["form"], seen[-1]["block_n"]) == ("stream", 16)
        decode_matmul(jnp.ones((3, 256)), values, scale, interpret=True)  # another shape: the defaults
        assert (seen[-1]["form"], seen[-1]["block_n"]) == ("reduce", 32)
        tuning.use("decode_matmul", shape_of(2, 64, 256, 8, jnp.int8), "xla")
        assert tuned(2, 64, 256, 8, jnp.int8) == "xla"
    finally:
        tuning.forget()


def test_unsupported_shapes_are_named():
    assert "rows" in unsupported(65, 64, 256, 2, jnp.int8)
    assert "int8, float8_e4m3fn, bf16" in unsupported(1, 64, 256, 0, jnp.int32)
    assert "with scales" in unsupported(1, 64, 256, 2, jnp.bfloat16)
    assert "with scales" in unsupported(1, 64, 256, 0, jnp.int8)
    assert "groups of 48" in unsupported(1, 64, 96, 2, jnp.int8)
    assert unsupported(1, 64, 256, 2, jnp.int8) is None and unsupported(16, 64, 256, 0, jnp.bfloat16) is None
    w = weight(64, 256, "int8", per_row=False)
    with pytest.raises(ValueError, match="rows"):
        decode_matmul(jnp.ones((65, 256)), w.values, w.scale, interpret=True)
    with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
        decode_matmul(jnp.ones((1, 256)), w.values, w.scale, interpret=True, launch=Launch(block_n=48))
    with pytest.raises(ValueError, match="form='tiles'"):
        decode_matmul(jnp.ones((1, 256)), w.values, w.scale, interpret=True, launch=Launch(form="tiles"))


def test_one_launch_fits_every_shape():
    """A launch too big for a matrix (set_default_launch serves them all) is halved to fit it."""
    assert resolve(Launch(block_n=128, splits=64, unroll=8), 1, 96, 256, 2) == ("reduce", 32, 128, 1, 2)
    w = weight(96, 256, "int8", per_row=False)
    x = normal((2, 256), 3)
    got = decode_matmul(x, w.values, w.scale, interpret=True, launch=Launch(block_n=128, splits=64, unroll=8))
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference(x, w.values, w.scale)), rtol=1e-5, atol=1e-5)


def _custom_call_targets(lowered) -> list[str]:
    found = []

    def visit(op):
        if op.name == "stablehlo.custom_call":
            found.append(ir.StringAttr(op.attributes["call_target_name"]).value)
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return found


@pytest.mark.parametrize("form,rows,dtype", [("reduce", 1, jnp.int8), ("reduce", 2, jnp.float8_e4m3fn),
                                             ("stream", 1, jnp.int8), ("dot", 16, jnp.int8), ("dot", 64, jnp.int8),
                                             ("reduce", 1, jnp.bfloat16), ("dot", 16, jnp.bfloat16),
                                             ("mosaic", 1, jnp.bfloat16), ("mosaic", 16, jnp.int8),
                                             ("mosaic", 64, jnp.float8_e4m3fn)])
def test_lowers_for_cuda(form, rows, dtype):
    """The Triton and Mosaic GPU lowering rules run here at Llama-3-8B's w_down shape; only the final
    compile needs a GPU (under `lowering_target("cuda")`: from JAX 0.11 the Triton lowering reads the
    target GPU's compute capability, which an abstract H100 gives it)."""
    from cbjax.runtime.compiled.lowering import lowering_target

    groups = 1 if form == "mosaic" else 112
    scale = None if dtype == jnp.bfloat16 else jax.ShapeDtypeStruct((4096, groups), jnp.float32)
    args = (jax.ShapeDtypeStruct((rows, 14336), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 14336), dtype))
    fn = jax.jit(lambda x, v, s: decode_matmul(x, v, s, launch=Launch(form=form)))
    with lowering_target("cuda"):  # traced inside it too: a trace made outside fails to lower on JAX 0.11
        lowered = fn.trace(*args, scale).lower(lowering_platforms=("cuda",))
    assert ("mosaic_gpu_v2" if form == "mosaic" else "__gpu$xla.gpu.triton") in _custom_call_targets(lowered)


MODEL = "tiny-llama"
PROMPTS = [[5, 9, 14, 3, 22, 8, 31], [17, 4, 4, 60], [2, 40, 11, 19, 27, 33, 6, 12, 50]]


def test_engine_tokens_equal_xla_dot():
    """An int8 engine with the kernel (interpreted here) gives the greedy tokens of XLA's dot, in
    decode (one to three rows: reduce) and prefill (past MAX_ROWS: XLA's dot either way)."""
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = {}
    for choice in ("pallas", "xla"):
        llm = LLM(MODEL, num_slots=4, max_seq_len=64, quantization="int8", quantized_matmul=choice)
        expected = engine_ops.PALLAS_MATMUL_INTERPRETED if choice == "pallas" else engine_ops.XLA
        assert engine_of(llm).ops is expected
        outs[choice] = [o.token_ids for o in llm.generate(PROMPTS, sampling, use_tqdm=False)]
    assert outs["pallas"] == outs["xla"]


def test_engine_choice_and_errors():
    from cbjax.runtime.cpu import kernels as cpu_kernels

    default = engine_of(LLM(MODEL, num_slots=2, max_seq_len=32, quantization="int8")).ops  # the CPU's int8 kernels
    assert default is (cpu_kernels.CPU_KERNELS if cpu_kernels.available() else engine_ops.XLA)
    with pytest.raises(ValueError, match="name two ways to multiply the 8-bit weights"):
        LLM(MODEL, num_slots=2, max_seq_len=32, quantization="int8", quantized_matmul="xla", cpu_kernels="on")
    assert engine_of(LLM(MODEL, num_slots=2, max_seq_len=32, quantized_matmul="pallas")).ops is not \
        engine_ops.PALLAS_MATMUL_INTERPRETED  # no 8-bit weights: nothing for the kernel
    with pytest.raises(ValueError, match="quantized_matmul must be one of"):
        LLM(MODEL, num_slots=2, max_seq_len=32, quantized_matmul="fast")
    if len(jax.devices()) >= 2:
        with pytest.raises(ValueError, match="quantized_matmul='pallas' runs on one device"):
            LLM(MODEL, num_slots=2, max_seq_len=32, quantization="int8", quantized_matmul="pallas",
                tensor_parallel=2)
