"""Every program of an engine with the Pallas kernels on, traced on this CPU and lowered for
cuda and for tpu (`lowering.lower_programs`): the Triton and Mosaic lowering rules run here, only the
final compile needs the accelerator. At tiny-llama's shape, SmolLM2-135M's (head_dim 64, GQA
9/3), Llama-3-8B's (head_dim 128, 8 KV heads), head sizes that are not powers of two
(Phi-2's 80, Phi-3-mini's 96) and sliding windows (Mistral-7B on every layer, Qwen2-7B on its
window layers), f32 and bf16, over the paged cache and the slot cache, under JAX's default
Pallas settings. The params are shapes only, so the 8B shape costs no memory."""

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
from cbjax.runtime.compiled.lowering import lower_programs
from cbjax.runtime.engine_config import EngineConfig
from tests.tiers import sweep

LLAMA3_8B = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position_embeddings=8192,
                        norm_eps=1e-5, rope_theta=500000.0, eos_token_ids=(128001,), bos_token_id=128000)
SHAPES = {
    "tiny-llama": RANDOM_PRESETS["tiny-llama"],
    "smollm2-135m": RANDOM_PRESETS["smollm2-135m-random"],
    "llama-3-8b": LLAMA3_8B,
    "hd80-phi-2": dataclasses.replace(LLAMA3_8B, hidden_size=2560, num_heads=32, num_kv_heads=32, head_dim=80,
                                      intermediate_size=10240, vocab_size=51200),
    "hd96-phi-3-mini": dataclasses.replace(LLAMA3_8B, hidden_size=3072, num_heads=32, num_kv_heads=32, head_dim=96,
                                           intermediate_size=8192, vocab_size=32064),
    "window-mistral-7b": dataclasses.replace(LLAMA3_8B, model_type="mistral", vocab_size=32000,
                                             sliding_windows=(4096,) * 32),
    "window-layers-qwen2-7b": dataclasses.replace(LLAMA3_8B, model_type="qwen2", hidden_size=3584, num_heads=28,
                                                  num_kv_heads=4, vocab_size=152064, sliding_windows=(0,) * 31 + (4096,)),
    # A mixture of experts: every token's top 2 of 8 experts by the grouped matmul (cbjax/models/moe.py).
    "moe-mixtral-8x7b": dataclasses.replace(LLAMA3_8B, model_type="mixtral", vocab_size=32000, rope_theta=1e6,
                                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
                                            norm_topk_prob=True),
}
KERNEL_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
KERNEL_NAMES = {"cuda": "cbjax_ragged_paged_attention", "tpu": "cbjax_ragged_paged_attention_tpu"}


def abstract_model(config: ModelConfig, dtype) -> Model:
    """Two layers (every layer lowers alike; a window model's two carry its windows) of
    `config`, its params as shapes only."""
    config = dataclasses.replace(config, num_layers=2, sliding_windows=config.sliding_windows[-2:])
    flat = flatten_shapes(param_shapes(config))
    return Model(config, unflatten({name: jax.ShapeDtypeStruct(shape, dtype) for name, shape in flat.items()}))


def ops_named(lowered, name: str) -> list:
    """Every op called `name` in a lowered program, nested regions included."""
    found = []

    def visit(op):
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return found


def custom_calls(lowered) -> list:
    return ops_named(lowered, "stablehlo.custom_call")


def data_dependent_control_flow(lowered) -> list[str]:
    """The conditionals and loops of a lowered program whose branch or trip count depends on
    data: a `case` whose index is not a constant (`platform_dependent`'s cases are: the
    platform is known), a `while` whose condition compares against anything but a constant
    (`scan`'s fixed trip counts do). On a GPU each of these waits for the device inside the
    step (XLA:GPU reads the predicate on the host)."""
    found = []

    def constant(value) -> bool:
        op = value.owner
        name = op.name if hasattr(op, "name") else ""
        if name == "stablehlo.constant":
            return True
        if name == "sdy.sharding_constraint":  # under explicit mesh axes JAX wraps every value in one
            return constant(op.operands[0])
        if name == "stablehlo.case":  # a platform index: a constant case whose branches return constants
            return constant(op.operands[0]) and all(
                constant(block.operations[len(block.operations) - 1].operands[0])
                for region in op.regions for block in region.blocks)
        return False

    def visit(op):
        if op.name == "stablehlo.case" and not constant(op.operands[0]):
            found.append("case")
        if op.name == "stablehlo.while":
            cond = op.regions[0].blocks[0]
            compare = [o for o in cond.operations if o.name == "stablehlo.compare"]
            if not compare or not any(constant(v) for v in compare[-1].operands):
                found.append("while")
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return found


def while_loops(lowered) -> int:
    """The `while` ops of a lowered program, fixed trip counts included. A one-step engine's
    programs have none on any admitted JAX: every loop is unrolled or a kernel's own (the
    Mosaic attention's work list searches with `method="compare_all"`, not a binary search's
    loop). A multi-step decode's scan is the one loop an engine program may hold."""
    return len(ops_named(lowered, "stablehlo.while"))


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


# f32 at the first three shapes; every shape in bf16 (what accelerators serve) over both layouts.
CASES = [(shape, "f32", "paged") for shape in ("tiny-llama", "smollm2-135m", "llama-3-8b")]
CASES += [(shape, "bf16", layout) for shape in sorted(SHAPES) for layout in ("paged", "slots")]


# The tiny model in bf16 only in the slow tier (its f32 programs and the larger shapes' bf16 ones are quick).
QUICK_CASES = [c for c in CASES if c[0] != "tiny-llama" or c[1] == "f32"]


@pytest.mark.parametrize("shape, dtype, layout", sweep(CASES, quick=QUICK_CASES, ids=["-".join(c) for c in CASES]))
def test_engine_programs_lower_for_cuda_and_tpu(shape, dtype, layout):
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    model = abstract_model(SHAPES[shape], dtype)
    engine = Engine(model, EngineConfig(num_slots=4, max_seq_len=256, kv_cache=layout, page_size=16,
                                        attention="pallas", cpu_kernels="off"))
    assert engine.attention == "pallas"
    # Every program of the tiny model; of the others, the smallest and largest token buckets
    # (one row, and a full step of prompt rows): the buckets between differ from these only in
    # their sizes, the shapes in their kernels' settings.
    programs = engine.programs() if shape == "tiny-llama" else [engine.programs()[0], engine.programs()[-1]]
    lowered = lower_programs(engine, ("cuda", "tpu"), programs=programs)
    assert set(lowered) == set(programs) and len(programs) > 1
    for program, by_platform in lowered.items():
        for platform, low in by_platform.items():
            where = f"{shape} {jnp.dtype(dtype).name} {program} {platform}"
            text = low.as_text()
            assert "f64" not in text, where
            if platform == "cuda":
                assert data_dependent_control_flow(low) == [] and while_loops(low) == 0, where
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
                                          (dict(head_dim=84), "head_dim"), (dict(head_dim=264), "head_dim")])
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


def test_the_slot_cache_needs_whole_kernel_pages():
    """A slot is read as a run of pages: max_seq_len must hold whole ones (16 tokens in bf16)."""
    model = abstract_model(RANDOM_PRESETS["tiny-llama"], jnp.bfloat16)
    with pytest.raises(ValueError, match="attention='pallas'.*max_seq_len .*multiple of 16"):
        Engine(model, EngineConfig(num_slots=2, max_seq_len=72, attention="pallas", cpu_kernels="off"))
    assert Engine(model, EngineConfig(num_slots=2, max_seq_len=80, attention="pallas", cpu_kernels="off")).attention \
        == "pallas"


@pytest.mark.parametrize("platform, layout, expected", [("cpu", "slots", "reference"), ("cpu", "paged", "reference"),
                                                        ("gpu", "slots", "pallas"), ("gpu", "paged", "pallas"),
                                                        ("tpu", "slots", "pallas")])
def test_auto_attention_is_the_kernel_on_accelerators(platform, layout, expected):
    """The default, attention='auto': the kernels wherever a GPU or TPU runs them, the reference
    path (and the C++ kernels) on a CPU; and the reference path where the kernel cannot run."""
    from cbjax.runtime.engine_choices import choose_attention

    model = abstract_model(LLAMA3_8B, jnp.bfloat16)
    config = EngineConfig(num_slots=4, max_seq_len=256, kv_cache=layout, page_size=16)
    assert config.attention == "auto"
    assert choose_attention(model, config, platform) == expected
    assert choose_attention(model, config, platform, tensor_parallel=2) == "reference"
    odd = EngineConfig(num_slots=4, max_seq_len=72, kv_cache="slots")
    assert choose_attention(model, odd, platform) == "reference"


def test_speculations_verify_programs_lower_for_cuda_and_tpu():
    """An engine that speculates (num_speculative_tokens=3): its verify programs, at SmolLM2's
    shape in bf16, lower for both platforms with the kernels and no data-dependent control flow
    on cuda; the all-greedy variant's sample at every position sorts nothing."""
    from cbjax.request import ALL, GREEDY

    model = abstract_model(SHAPES["smollm2-135m"], jnp.bfloat16)
    engine = Engine(model, EngineConfig(num_slots=4, max_seq_len=256, kv_cache="paged", page_size=16,
                                        attention="pallas", cpu_kernels="off", num_speculative_tokens=3,
                                        min_step_tokens=16, max_step_tokens=32))
    verify = [p for p in engine.programs() if p[0] == "verify"]
    assert verify and engine.verify_positions == 4
    lowered = lower_programs(engine, ("cuda", "tpu"), samplers=(ALL, GREEDY))
    for program in verify:
        for sampler in (ALL, GREEDY):
            by_platform = lowered[(*program, sampler)]
            assert data_dependent_control_flow(by_platform["cuda"]) == [], program
            for platform, low in by_platform.items():
                assert {attribute(c, "call_target_name") for c in custom_calls(low)} == {KERNEL_CALLS[platform]}
            text = by_platform["cuda"].as_text()
            sorts, top_k = text.count("stablehlo.sort"), "top_k" in text or "topk" in text.lower()
            assert (sorts == 0 and not top_k) if sampler == GREEDY else (sorts >= 1 and top_k), (program, sampler)


MOSAIC_ATTENTION = "form=mosaic,kv_splits=2,num_stages=2,pages_per_block=4"


@pytest.mark.parametrize("attention", sweep(["kv_splits=4", MOSAIC_ATTENTION], quick={MOSAIC_ATTENTION}))
def test_tuned_launches_lower_for_cuda(attention):
    """The programs of a GPU engine after its tuning (Llama-3-8B's shape, bf16, paged): with
    split-KV chosen for the attention kernel (Triton's, or its Mosaic GPU form) and the decode
    matmul's Mosaic GPU form chosen over XLA's dot for the bf16 weights at the decode buckets,
    every program lowers for cuda with no data-dependent control flow; the decode-sized programs
    call the Mosaic GPU kernel for every matrix, the larger ones for the LM head only; the
    attention is the Triton call or one more Mosaic GPU call, as chosen."""
    from cbjax.runtime import engine_ops
    from cbjax.runtime.compiled import kernel_tuning
    from pallas_kernels import decode_matmul, ragged_paged_attention, tuning

    model = abstract_model(SHAPES["llama-3-8b"], jnp.bfloat16)
    engine = Engine(model, EngineConfig(num_slots=4, max_seq_len=256, kv_cache="paged", page_size=16,
                                        attention="pallas", cpu_kernels="off", min_step_tokens=16,
                                        max_step_tokens=128))
    engine.ops = engine_ops.PALLAS_MATMUL  # what a GPU engine runs (engine_ops picks by the device)
    tuning.forget()
    try:
        calls = kernel_tuning.kernel_calls(engine)
        for kernel, shape in calls:
            tuning.use(kernel, shape, attention if kernel == ragged_paged_attention.KERNEL else "form=mosaic")
        matmul_rows = {shape[0] for kernel, shape in calls if kernel == decode_matmul.KERNEL}
        assert matmul_rows and max(matmul_rows) <= decode_matmul.MAX_ROWS
        jax.clear_caches()
        lowered = lower_programs(engine, ("cuda",))
        for program, by_platform in lowered.items():
            low = by_platform["cuda"]
            assert data_dependent_control_flow(low) == [] and while_loops(low) == 0, program
            targets = [attribute(c, "call_target_name") for c in custom_calls(low)]
            mosaic_attention = attention.startswith("form=mosaic")
            assert ("__gpu$xla.gpu.triton" in targets) != mosaic_attention, program
            # A kernel call per distinct matrix shape (calls of one shape share one function): the
            # five of Llama-3-8B in a decode-sized program; past 64 rows only the LM head over
            # the rows that sample (one per slot at most) stays decode-sized.
            matmuls = 5 if program[1] <= decode_matmul.MAX_ROWS else 1
            assert targets.count("mosaic_gpu_v2") == matmuls + mosaic_attention, program
    finally:
        tuning.forget()
        jax.clear_caches()


def test_lora_adapters_programs_lower_for_cuda_and_tpu():
    """An engine serving LoRA adapters (enable_lora, rank 16 on every projection): its step
    programs at SmolLM2's shape in bf16 lower for both platforms with each token's adapter
    gathered in XLA, the attention kernel the only custom call, no data-dependent control flow
    on cuda."""
    model = abstract_model(SHAPES["smollm2-135m"], jnp.bfloat16)
    lowered = {}
    for lora in (True, False):
        engine = Engine(model, EngineConfig(num_slots=4, max_seq_len=256, kv_cache="paged", page_size=16,
                                            attention="pallas", cpu_kernels="off", enable_lora=lora, max_loras=4,
                                            max_lora_rank=16, min_step_tokens=16, max_step_tokens=32))
        programs = engine.programs()
        lowered[lora] = lower_programs(engine, ("cuda", "tpu"), programs=[programs[0], programs[-1]])
    for program, by_platform in lowered[True].items():
        assert data_dependent_control_flow(by_platform["cuda"]) == [], program
        for platform, low in by_platform.items():
            gathers = low.as_text().count("stablehlo.gather")
            assert gathers > lowered[False][program][platform].as_text().count("stablehlo.gather"), (program, platform)
            assert {attribute(c, "call_target_name") for c in custom_calls(low)} == {KERNEL_CALLS[platform]}
