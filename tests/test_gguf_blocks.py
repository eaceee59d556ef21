"""quantization='gguf': a GGUF file's quantized matrices kept in its own blocks. The blocks'
dequantization against the `gguf` package's for every block type read, the embedded SmolLM2
Q4_1 file run from its blocks (greedy tokens identical to the same weights dequantized to f32,
resident weight bytes those of the file's tensors), and the errors."""

from __future__ import annotations

import gc
import itertools
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.models import quant
from cbjax.models.gguf_blocks import BLOCK_TYPES, GGUFWeight, check_kind, dequantize_rows
from tests.tiers import slow
from tests.internals import engine_of

presets = pytest.importorskip("cbjax.loading.presets")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_dequantization_matches_the_gguf_package(kind):
    """Super-blocks of 256 with packed sub-block scales: random block bytes (any bits are a valid
    block, the f16 scales set to sane values) dequantized bit for bit as the gguf package does."""
    rng = np.random.default_rng(5)
    per_block, size = BLOCK_TYPES[kind]
    blocks = rng.integers(0, 256, size=(4, 3, size), dtype=np.uint8)
    for at in ((0, 2) if kind == "Q4_K" else (208,)):
        blocks[..., at:at + 2] = np.frombuffer(np.float16(0.03).tobytes(), np.uint8)
    blocks = blocks.reshape(4, 3 * size)
    want = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind))
    np.testing.assert_array_equal(np.asarray(dequantize_rows(jnp.asarray(blocks), kind)), want)
    weight = GGUFWeight(jnp.asarray(blocks), kind)
    assert weight.shape == (4, 3 * per_block)
    from cbjax.models.ops import XLA

    x = rng.normal(size=(2, 3 * per_block)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(XLA.dense(jnp.asarray(x), weight)), x @ want.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_block_dequantization_matches_the_gguf_package(kind):
    rng = np.random.default_rng(len(kind))
    w = (rng.normal(size=(6, 96)) * rng.uniform(0.01, 3, size=(6, 1))).astype(np.float32)
    w[0, :32] = 0  # an all-zero block
    blocks = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))
    assert blocks.shape == (6, 96 // 32 * BLOCK_TYPES[kind][1]) and blocks.dtype == np.uint8
    want = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind))
    got = np.asarray(dequantize_rows(jnp.asarray(blocks), kind))
    np.testing.assert_array_equal(got, want)
    weight = GGUFWeight(jnp.asarray(blocks), kind)
    assert weight.shape == (6, 96) and weight.nbytes == blocks.nbytes
    x = rng.normal(size=(3, 96)).astype(np.float32)
    from cbjax.models.ops import XLA

    np.testing.assert_allclose(np.asarray(XLA.dense(jnp.asarray(x), weight)), x @ want.T, rtol=1e-5, atol=1e-5)
    rows = np.asarray(quant.embedding_rows(weight, jnp.asarray([[2, 0]]), jnp.float32))
    np.testing.assert_array_equal(rows[0], want[[2, 0]])


@slow
def test_smollm2_runs_from_its_own_blocks():
    """The embedded Q4_1 file (its embedding Q8_0): every matrix stays in its blocks, the
    resident weight bytes are the file's tensor bytes, and greedy decoding gives the tokens of
    the same weights dequantized to f32 (the same products: the blocks are widened exactly)."""
    try:
        path = presets.smollm2_gguf_path()
    except FileNotFoundError as e:  # pragma: no cover - CI installs it
        pytest.skip(str(e))
    reader = gguf.GGUFReader(path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    llm = LLM(path, quantization="gguf", num_slots=2, max_seq_len=96)
    params = engine_of(llm).params
    kinds = {leaf.kind for leaf in jax.tree.leaves(params, is_leaf=quant.is_quantized) if quant.is_quantized(leaf)}
    assert kinds == {"Q4_1", "Q8_0"} and params["embed"].kind == "Q8_0"
    from cbjax.runtime.cpu import kernels as cpu_kernels

    assert quant.quantization_of(params) == "gguf"
    assert (engine_of(llm).ops is cpu_kernels.CPU_KERNELS) == cpu_kernels.available()  # its block kernel decodes
    # and one layer-kernel call a layer decodes, the weights named by address
    assert (engine_of(llm)._params_by_address is not None) == cpu_kernels.available()
    assert quant.weight_bytes(params) == file_bytes  # norms in f32 as the file holds them, blocks as they are
    prompt = llm.model.tokenizer("The Eiffel Tower is in the city of")["input_ids"]
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    got = llm.generate([prompt, prompt[:4]], sampling, use_tqdm=False)
    reference = LLM(path, num_slots=2, max_seq_len=96, cpu_kernels="off").generate([prompt, prompt[:4]], sampling,
                                                                                   use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in reference]


def test_gguf_errors_name_the_knob(tmp_path):
    with pytest.raises(ValueError, match="GGUF block type Q5_K is not one quantization='gguf' reads"):
        check_kind("Q5_K", "model.gguf: tensor 'blk.0.ffn_down.weight'")
    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's blocks"):
        LLM("tiny-llama", quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's blocks"):
        quant.quantize_params({"layers": []}, "gguf", False)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_cpu_block_kernel_matches_the_dequantized_product(kind):
    """The C++ kernel (blocks widened in registers) against x @ dequantized.T, at one row, odd
    row counts and the most rows it takes; the engine's decode sends GGUF matmuls to it."""
    from cbjax.runtime.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.build_error())
    rng = np.random.default_rng(3)
    for width in (192, 224):  # 6 and 7 blocks a row: one row's loop takes blocks in pairs, then the last alone
        w = rng.normal(size=(37, width)).astype(np.float32)  # an odd number of weight rows: a last row alone
        blocks = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))
        weight = GGUFWeight(jnp.asarray(blocks), kind)
        dense = np.asarray(dequantize_rows(jnp.asarray(blocks), kind))
        for rows, transposed in itertools.product((1, 3, 30, cpu_kernels.MAX_ROWS), (False, True)):
            x = rng.normal(size=(rows, width)).astype(np.float32)
            assert cpu_kernels.blocks_fit(jnp.asarray(x), weight)
            with cpu_kernels.pinned_form(transposed):  # widened rows against x or against its transpose
                got = np.asarray(jax.jit(cpu_kernels.matmul_blocks)(jnp.asarray(x), weight))
            np.testing.assert_allclose(got, x @ dense.T, rtol=1e-5, atol=1e-4)
        assert not cpu_kernels.blocks_fit(jnp.zeros((cpu_kernels.MAX_ROWS + 1, width)), weight)


@slow
def test_a_q8_0_copy_runs_from_its_blocks(tmp_path):
    """SmolLM2's Q4_1 file written again in Q8_0 blocks (metadata and norms as they were): the
    engine holds exactly its tensor bytes and decodes the tokens of its dequantized weights."""
    from cbjax.loading.gguf_requantize import requantize_gguf

    try:
        path = presets.smollm2_gguf_path()
    except FileNotFoundError as e:  # pragma: no cover - CI installs it
        pytest.skip(str(e))
    target = str(tmp_path / "smollm2-q8_0.gguf")
    sizes = requantize_gguf(path, target, "Q8_0")
    assert sizes["target_tensor_bytes"] > sizes["source_tensor_bytes"]  # 8.5 bits a weight against 5
    llm = LLM(target, quantization="gguf", num_slots=2, max_seq_len=64)
    kinds = {leaf.kind for leaf in jax.tree.leaves(engine_of(llm).params, is_leaf=quant.is_quantized)
             if quant.is_quantized(leaf)}
    assert kinds == {"Q8_0"} and quant.weight_bytes(engine_of(llm).params) == sizes["target_tensor_bytes"]
    gc.collect()  # and only those: no tensor keeps the file's map (and its read pages) alive
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            assert os.path.realpath(target) not in maps.read()
    prompt = llm.model.tokenizer("The Eiffel Tower is in")["input_ids"]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    reference = LLM(target, num_slots=2, max_seq_len=64, cpu_kernels="off")
    assert (llm.generate([prompt], sampling, use_tqdm=False)[0].token_ids
            == reference.generate([prompt], sampling, use_tqdm=False)[0].token_ids)
    with pytest.raises(ValueError, match="GGUF block type Q5_K"):
        requantize_gguf(path, str(tmp_path / "x.gguf"), "Q5_K")
