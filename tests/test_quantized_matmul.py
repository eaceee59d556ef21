"""The Pallas quantized matmul (pallas_kernels/quantized_matmul): its body in interpret mode
against the pure-JAX reference for each form, 8-bit format, scale layout and row count; the
reference against the dequantized product; the Triton lowering for cuda traced on this CPU;
the shapes it refuses; and an engine running it (EngineConfig.quantized_matmul='pallas',
interpreted) giving the tokens of XLA's int8 dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib.mlir import ir

from cbjax import LLM, SamplingParams
from cbjax.models import quant
from cbjax.runtime import engine_ops
from pallas_kernels.quantized_matmul import Launch, quantized_matmul, reference, resolve, unsupported

FORMS = ("reduce", "stream", "dot")


def weight(out_dim: int, in_dim: int, mode: str, per_row: bool, seed: int = 0) -> quant.QuantizedWeight:
    w = quant.quantize(jax.random.normal(jax.random.key(seed), (out_dim, in_dim)) * 0.05, mode)
    return quant.QuantizedWeight(w.values, w.scale[:, :1]) if per_row else w


@pytest.mark.parametrize("form,rows", [(f, r) for f in FORMS for r in (1, 3, 16) if f == "dot" or r <= 4])
@pytest.mark.parametrize("mode,per_row", [("int8", False), ("int8", True), ("fp8", False)])
def test_kernel_matches_reference(form, rows, mode, per_row):
    w = weight(64, 1024, mode, per_row, seed=rows)
    x = jax.random.normal(jax.random.key(100 + rows), (rows, 1024))
    want = np.asarray(reference(x, w.values, w.scale))
    for launch in (Launch(form=form), Launch(form=form, block_n=16, splits=2, unroll=2)):
        got = np.asarray(quantized_matmul(x, w.values, w.scale, interpret=True, launch=launch))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_reference_is_the_dequantized_product():
    w = weight(48, 256, "int8", per_row=False)
    x = jax.random.normal(jax.random.key(1), (5, 256))
    np.testing.assert_allclose(np.asarray(reference(x, w.values, w.scale)), np.asarray(x @ w.dequantize().T),
                               rtol=1e-5, atol=1e-5)


def test_leading_dims_and_dtype_kept():
    w = weight(32, 128, "int8", per_row=False)
    x = jax.random.normal(jax.random.key(2), (2, 1, 128)).astype(jnp.bfloat16)
    y = quantized_matmul(x, w.values, w.scale, interpret=True)
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


def test_unsupported_shapes_are_named():
    assert "rows" in unsupported(65, 64, 256, 2, jnp.int8)
    assert "int8 or float8" in unsupported(1, 64, 256, 2, jnp.bfloat16)
    assert "groups of 48" in unsupported(1, 64, 96, 2, jnp.int8)
    assert unsupported(1, 64, 256, 2, jnp.int8) is None
    w = weight(64, 256, "int8", per_row=False)
    with pytest.raises(ValueError, match="rows"):
        quantized_matmul(jnp.ones((65, 256)), w.values, w.scale, interpret=True)
    with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
        quantized_matmul(jnp.ones((1, 256)), w.values, w.scale, interpret=True, launch=Launch(block_n=48))
    with pytest.raises(ValueError, match="form='tiles'"):
        quantized_matmul(jnp.ones((1, 256)), w.values, w.scale, interpret=True, launch=Launch(form="tiles"))


def test_one_launch_fits_every_shape():
    """A launch too big for a matrix (set_default_launch serves them all) is halved to fit it."""
    assert resolve(Launch(block_n=128, splits=64, unroll=8), 1, 96, 256, 2) == ("reduce", 32, 128, 1, 2)
    w = weight(96, 256, "int8", per_row=False)
    x = jax.random.normal(jax.random.key(3), (2, 256))
    got = quantized_matmul(x, w.values, w.scale, interpret=True, launch=Launch(block_n=128, splits=64, unroll=8))
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference(x, w.values, w.scale)), rtol=1e-5, atol=1e-5)


def _custom_call_targets(lowered) -> list[str]:
    found = []

    def visit(op):
        if op.name == "stablehlo.custom_call":
            found.append(ir.StringAttr(op.attributes["call_target_name"]).value)
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return found


@pytest.mark.parametrize("form,rows", [("reduce", 1), ("reduce", 2), ("stream", 1), ("dot", 16), ("dot", 64)])
def test_lowers_to_triton_for_cuda(form, rows):
    """The Triton lowering rules run here at Llama-3-8B's w_down shape; only the final compile needs a GPU
    (under `lowering_target("cuda")`: from JAX 0.11 the Triton lowering reads the target GPU's compute
    capability, which an abstract H100 gives it)."""
    from cbjax.runtime.lowering import lowering_target

    args = (jax.ShapeDtypeStruct((rows, 14336), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 14336), jnp.int8),
            jax.ShapeDtypeStruct((4096, 112), jnp.float32))
    fn = jax.jit(lambda x, v, s: quantized_matmul(x, v, s, launch=Launch(form=form)))
    with lowering_target("cuda"):  # traced inside it too: a trace made outside fails to lower on JAX 0.11
        lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in _custom_call_targets(lowered)


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
        assert llm.engine.ops is expected
        outs[choice] = [o.token_ids for o in llm.generate(PROMPTS, sampling, use_tqdm=False)]
    assert outs["pallas"] == outs["xla"]


def test_engine_choice_and_errors():
    from cbjax.runtime.cpu import kernels as cpu_kernels

    default = LLM(MODEL, num_slots=2, max_seq_len=32, quantization="int8").engine.ops  # the CPU's int8 kernels
    assert default is (cpu_kernels.CPU_KERNELS if cpu_kernels.available() else engine_ops.XLA)
    with pytest.raises(ValueError, match="name two ways to multiply the 8-bit weights"):
        LLM(MODEL, num_slots=2, max_seq_len=32, quantization="int8", quantized_matmul="xla", cpu_kernels="on")
    assert LLM(MODEL, num_slots=2, max_seq_len=32, quantized_matmul="pallas").engine.ops is not \
        engine_ops.PALLAS_MATMUL_INTERPRETED  # no 8-bit weights: nothing for the kernel
    with pytest.raises(ValueError, match="quantized_matmul must be one of"):
        LLM(MODEL, num_slots=2, max_seq_len=32, quantized_matmul="fast")
    if len(jax.devices()) >= 2:
        with pytest.raises(ValueError, match="quantized_matmul='pallas' runs on one device"):
            LLM(MODEL, num_slots=2, max_seq_len=32, quantization="int8", quantized_matmul="pallas",
                tensor_parallel=2)
