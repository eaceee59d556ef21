"""Fused projections (cbjax/models/fusion.py): q/k/v and gate/up as one matmul each decode the
unfused engine's tokens in every family, quantized weights included; the cuda-lowered step has
three fewer matmuls a layer; the knob fuses where it can and refuses, naming itself, where not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.loading import Model
from cbjax.models import fusion, quant
from cbjax.runtime.engine import Engine
from cbjax.runtime.engine_choices import wants_fusion
from cbjax.runtime.engine_config import EngineConfig
from cbjax.runtime.compiled.lowering import lower_programs
from cbjax.request import ALL
from tests.test_cross_lowering import LLAMA3_8B, abstract_model
from tests.tiers import sweep
from tests.internals import engine_of

PROMPTS = [[3, 17, 25, 9, 4, 11], [5, 6, 7], list(range(20, 41))]


def _outputs(llm: LLM) -> list:
    greedy = SamplingParams(max_tokens=7, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.9, top_p=0.8, seed=5)
    return llm.generate(PROMPTS, [greedy, sampled, greedy], use_tqdm=False)


@pytest.mark.parametrize("model, options", sweep([
    ("tiny-llama", dict(kv_cache="paged", page_size=16)),
    ("tiny-qwen2", {}),  # q/k/v biases
    ("tiny-qwen3", {}),  # q/k norms after the split
    ("tiny-gpt2", {}),  # fused q/k/v; an ungated MLP stays as it is
    # int8 values and scales fused alike, through the Pallas decode matmul (interpreted here) as on a GPU
    ("tiny-mistral", dict(quantization="int8", quantized_matmul="pallas", max_step_tokens=16)),
], quick=[("tiny-llama", dict(kv_cache="paged", page_size=16))]))
def test_fused_engines_decode_the_unfused_tokens(model, options):
    plain = LLM(model, num_slots=3, max_seq_len=64, fuse_projections="off", **options)
    fused = LLM(model, num_slots=3, max_seq_len=64, fuse_projections="on", **options)
    layers = engine_of(fused).params["layers"]
    assert all("wqkv" in p and not {"wq", "wk", "wv"} & set(p) for p in layers)
    assert all(("w_gate_up" in p) == (model != "tiny-gpt2") for p in layers)
    assert not fusion.is_fused(engine_of(plain).params)
    assert fused.engine_info.fused_projections and not plain.engine_info.fused_projections
    for a, b in zip(_outputs(plain), _outputs(fused)):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs or []) == len(b.logprobs or [])
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            np.testing.assert_allclose([x.logprob, *(v for _, v in x.top)], [y.logprob, *(v for _, v in y.top)],
                                       atol=1e-5)


def test_fused_weights_are_their_parts_side_by_side():
    rng = np.random.default_rng(0)
    parts = {n: jnp.asarray(rng.normal(size=(s, 64)), jnp.float32) for n, s in (("wq", 32), ("wk", 16), ("wv", 16))}
    grouped = quant.quantize_params({"layers": [parts]}, "int8", False)["layers"][0]
    for layer in (parts, grouped):
        fused = fusion.fuse_layer(layer)["wqkv"]
        dense = fused.dequantize() if quant.is_quantized(fused) else fused
        want = [layer[n].dequantize() if quant.is_quantized(layer[n]) else layer[n] for n in ("wq", "wk", "wv")]
        np.testing.assert_array_equal(dense, jnp.concatenate(want))
    mixed = {**grouped, "wv": parts["wv"]}  # one part float, two quantized: left as they are
    assert fusion.fuse_layer(mixed) is mixed
    only_two_biases = {**parts, "bq": jnp.zeros(32), "bk": jnp.zeros(16)}
    assert "wqkv" not in fusion.fuse_layer(only_two_biases)

    owned = {"layers": [dict(parts)]}
    fused = fusion.fuse_projections(owned, release=True)
    assert all(a.is_deleted() for a in parts.values()) and not fused["layers"][0]["wqkv"].is_deleted()


def test_the_cuda_step_has_three_fewer_matmuls_a_layer():
    config = EngineConfig(num_slots=4, max_seq_len=256, kv_cache="paged", page_size=16, attention="pallas",
                          cpu_kernels="off", max_step_tokens=16)
    model = abstract_model(LLAMA3_8B, jnp.bfloat16)
    fused_model = Model(model.config, jax.eval_shape(fusion.fuse_projections, model.params))
    counts = []
    for m in (model, fused_model):
        lowered = lower_programs(Engine(m, config), ("cuda",), samplers=(ALL,))
        counts.append({key: by_platform["cuda"].as_text().count("stablehlo.dot_general")
                       for key, by_platform in lowered.items()})
    assert counts[0].keys() == counts[1].keys() and counts[0]
    for key in counts[0]:  # (q, k, v -> qkv; gate, up -> gate_up) in each layer
        assert counts[0][key] - counts[1][key] == 3 * model.config.num_layers, key


def test_the_knob_fuses_where_it_can_and_refuses_naming_itself():
    assert wants_fusion("auto", "gpu", "none") and wants_fusion("auto", "tpu", "int8")
    assert not wants_fusion("auto", "cpu", "none")  # the C++ layer kernel reads each matrix
    assert not wants_fusion("auto", "gpu", "none", tensor_parallel=2)
    assert wants_fusion("on", "cpu", "none") and not wants_fusion("off", "gpu", "none")
    with pytest.raises(ValueError, match="fuse_projections='on': tensor parallelism"):
        wants_fusion("on", "gpu", "none", tensor_parallel=2)
    with pytest.raises(ValueError, match="fuse_projections must be one of"):
        LLM("tiny-llama", num_slots=2, max_seq_len=32, fuse_projections="sometimes")
    assert "wq" in engine_of(LLM("tiny-llama", num_slots=2, max_seq_len=32)).params["layers"][0]  # auto on a CPU
