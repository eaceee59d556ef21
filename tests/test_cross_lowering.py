"""Every program of an engine with the Pallas kernels on, traced on this CPU and lowered for
cuda and for tpu (`Engine.lowered`): the Triton and Mosaic lowering rules run here, only the
final compile needs the accelerator. At tiny-llama's shape, SmolLM2-135M's (head_dim 64, GQA
9/3) and Llama-3-8B's (head_dim 128, 8 KV heads), f32 and bf16, under JAX's default Pallas
settings. The params are shapes only, so the 8B shape costs no memory."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir

from cbjax.config import ModelConfig
from cbjax.loading.model import Model
from cbjax.loading.presets import RANDOM_PRESETS
from cbjax.models.params import flatten_shapes, param_shapes, unflatten
from cbjax.runtime.engine import Engine
from cbjax.runtime.engine_config import EngineConfig

LLAMA3_8B = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position_embeddings=8192,
                        norm_eps=1e-5, rope_theta=500000.0, eos_token_ids=(128001,), bos_token_id=128000)
SHAPES = {
    "tiny-llama": RANDOM_PRESETS["tiny-llama"],
    "smollm2-135m": RANDOM_PRESETS["smollm2-135m-random"],
    "llama-3-8b": LLAMA3_8B,
}
KERNEL_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
KERNEL_NAMES = {"cuda": "cbjax_ragged_paged_attention", "tpu": "cbjax_ragged_paged_attention_tpu"}


def abstract_model(config: ModelConfig, dtype) -> Model:
    """Two layers (every layer lowers alike) of `config`, its params as shapes only."""
    config = dataclasses.replace(config, num_layers=2)
    flat = flatten_shapes(param_shapes(config))
    return Model(config, unflatten({name: jax.ShapeDtypeStruct(shape, dtype) for name, shape in flat.items()}))


def custom_calls(lowered) -> list:
    """Every stablehlo.custom_call op of a lowered program, nested regions included."""
    found = []

    def visit(op):
        if op.name == "stablehlo.custom_call":
            found.append(op)
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return found


def attribute(op, name: str) -> str:
    return ir.StringAttr(op.attributes[name]).value


def verify_triton(op) -> str:
    """The Triton module a Triton call carries, parsed and verified with Triton's dialect; its text."""
    from jax._src.lib.triton import dialect as tt_dialect

    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    assert ir.StringAttr(config["name"]).value == KERNEL_NAMES["cuda"]
    context = ir.Context()
    tt_dialect.register_dialect(context)
    with context:
        module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
        assert module.operation.verify()
        return str(module)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_engine_programs_lower_for_cuda_and_tpu(shape, dtype):
    model = abstract_model(SHAPES[shape], dtype)
    engine = Engine(model, EngineConfig(num_slots=4, max_seq_len=256, kv_cache="paged", page_size=16,
                                        attention="pallas", cpu_kernels="off"))
    lowered = engine.lowered(("cuda", "tpu"))
    assert set(lowered) == set(engine.programs())
    for program, by_platform in lowered.items():
        for platform, low in by_platform.items():
            where = f"{shape} {jnp.dtype(dtype).name} {program} {platform}"
            text = low.as_text()
            assert "f64" not in text, where
            calls = custom_calls(low)
            # One kernel function shared by the layers; nothing else leaves XLA: no host
            # callback, no CPU FFI call (the C++ CPU kernels), no interpret-mode fallback.
            assert {attribute(c, "call_target_name") for c in calls} == {KERNEL_CALLS[platform]}, where
            for call in calls:
                operand_types = " ".join(str(o.type) for o in call.operands)
                assert jnp.dtype(dtype).name.replace("float", "f").replace("bfloat", "bf") in operand_types, where
                if platform == "cuda":
                    module = verify_triton(call)
                    assert module.count("tt.dot") == 2, where  # q.k and p.v on the tensor cores
                    if dtype == jnp.bfloat16:
                        assert "!tt.ptr<bf16>" in module, where
                else:
                    assert KERNEL_NAMES["tpu"] in text, where


@pytest.mark.parametrize("change, knob", [(dict(page_size=24), "page_size"), (dict(page_size=4), "page_size"),
                                          (dict(head_dim=96), "head_dim"), (dict(head_dim=40), "head_dim")])
def test_engine_refuses_a_kernel_configuration_at_build(change, knob):
    page_size = change.pop("page_size", 16)
    config = dataclasses.replace(RANDOM_PRESETS["tiny-llama"], **change)
    with pytest.raises(ValueError, match=f"attention='pallas'.*{knob}"):
        Engine(abstract_model(config, jnp.float32),
               EngineConfig(num_slots=2, max_seq_len=96 if page_size == 24 else 64, kv_cache="paged",
                            page_size=page_size, attention="pallas", cpu_kernels="off"))


def test_engine_refuses_bf16_pages_of_eight():
    with pytest.raises(ValueError, match="page_size a power of two >= 16 for bfloat16"):
        Engine(abstract_model(RANDOM_PRESETS["tiny-llama"], jnp.bfloat16),
               EngineConfig(num_slots=2, max_seq_len=64, kv_cache="paged", page_size=8, attention="pallas",
                            cpu_kernels="off"))
