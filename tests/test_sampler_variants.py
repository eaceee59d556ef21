"""Sampler variants (runtime/compiled/step_programs.py): the program of an all-greedy step lowered for
cuda holds no vocabulary sort and no top-k; a GPU's choice of variants, forced on this CPU,
draws the same tokens and logprobs as the one program that holds every part of sampling."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.request import ALL, GREEDY, Sampler
from cbjax.loading.presets import RANDOM_PRESETS
from cbjax.runtime.engine import Engine
from cbjax.runtime.engine_config import EngineConfig
from cbjax.runtime.compiled.lowering import lower_programs
from cbjax.runtime.compiled.step_programs import SamplerVariants
from cbjax.scheduling.plan import Row
from tests.test_cross_lowering import LLAMA3_8B, abstract_model
from tests.tiers import sweep
from tests.internals import engine_of, scheduler_of


def test_warmup_variants_per_platform():
    assert SamplerVariants(2, "cpu").ahead == SamplerVariants(2, "tpu").ahead == (ALL,)
    assert SamplerVariants(2, "gpu").ahead == SamplerVariants(2, "cuda").ahead == (ALL, GREEDY)


@pytest.mark.parametrize("shape", ["tiny-llama", "llama-3-8b"])
def test_all_greedy_cuda_program_holds_no_sort(shape):
    config = RANDOM_PRESETS["tiny-llama"] if shape == "tiny-llama" else LLAMA3_8B
    engine = Engine(abstract_model(config, jnp.bfloat16),
                    EngineConfig(num_slots=4, max_seq_len=256, kv_cache="paged", page_size=16, attention="pallas",
                                 cpu_kernels="off", max_logprobs=5, decode_steps=2, max_step_tokens=16))
    lowered = lower_programs(engine, ("cuda",), samplers=(ALL, GREEDY, Sampler.DRAW))
    vocab = config.vocab_size
    for (_, _, _, sampler), by_platform in lowered.items():
        text = by_platform["cuda"].as_text()
        sorts = text.count("stablehlo.sort")
        top_k = "top_k" in text or "topk" in text.lower()
        if sampler == GREEDY:
            assert sorts == 0 and not top_k, f"the greedy program sorts or takes a top-k ({sampler!r})"
            assert f"x{vocab}xf32" in text  # the logits are there: it does read the vocabulary
        elif sampler == ALL:
            assert sorts >= 1 and top_k  # the check above can fail: the full program has both
        else:
            assert sorts == 0 and not top_k  # temperature and min-p draw without a sort


def _row(slot, sampling=None, is_last=False):
    return Row(slot, [1] if is_last else [], 0, is_last=is_last, sampling=sampling)


def test_a_call_runs_the_union_of_its_rows_needs():
    variants = SamplerVariants(4, "gpu")
    variants.reset()
    assert variants.for_rows([_row(0), _row(1)]) == GREEDY
    sampled = SamplingParams(temperature=0.7)
    assert variants.for_rows([_row(0, sampled, is_last=True), _row(1)]) == Sampler.DRAW
    assert variants.for_rows([_row(0)]) == Sampler.DRAW  # a decode row by slot alone: its request's needs
    assert variants.for_rows([_row(2, SamplingParams(top_p=0.9, temperature=1.0), True)]) == Sampler.DRAW | Sampler.SORT
    assert variants.for_rows([_row(3, SamplingParams(logprobs=2, repetition_penalty=1.2), True)]) \
        == Sampler.LOGPROBS | Sampler.PROCESS
    assert variants.for_rows([_row(0, SamplingParams(), True)]) == GREEDY  # the slot's new request is greedy
    variants.slot_replaced(1)  # a swapped-in sequence: its request's needs are not known here
    assert variants.for_rows([_row(1)]) == ALL
    assert SamplerVariants(4, "cpu").for_rows([_row(0)]) == ALL


SAMPLINGS = [SamplingParams(max_tokens=9, ignore_eos=True),
             SamplingParams(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=9, temperature=1.2, top_k=7, seed=4, ignore_eos=True),
             SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, min_p=0.05, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=9, repetition_penalty=1.3, logit_bias={7: 5.0}, ignore_eos=True),
             SamplingParams(max_tokens=9, logprobs=3, ignore_eos=True)]


def _outputs(llm, prompts, samplings):
    outs = llm.generate(prompts, samplings, use_tqdm=False)
    return [(o.token_ids, [(lp.token_id, round(lp.logprob, 5)) for lp in o.logprobs or []]) for o in outs]


@pytest.mark.parametrize("layout", sweep([dict(), dict(kv_cache="paged", page_size=8, merge_mode="chunked",
                                                       max_num_batched_tokens=16)], quick=[dict()]))
def test_specialized_variants_draw_what_the_full_program_draws(layout):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(3, 20, size=12)]
    # Mixes in one call: greedy rows beside each kind of sampled row, and calls of greedy rows alone.
    groups = [[SAMPLINGS[0]] * 4, [SAMPLINGS[0], SAMPLINGS[1]] * 2, SAMPLINGS[:4], SAMPLINGS[4:] * 2]
    kwargs = dict(num_slots=4, max_seq_len=64, max_logprobs=4, seed=0, **layout)
    reference = LLM("tiny-llama", **kwargs)
    assert not engine_of(reference).samplers.specializes
    expected = [_outputs(reference, prompts[:len(g)], g) for g in groups]

    llm = LLM("tiny-llama", **kwargs)
    engine_of(llm).samplers.specializes = True  # as on a GPU
    first = [_outputs(llm, prompts[:len(g)], g) for g in groups]  # ALL serves while the variants compile
    assert engine_of(llm).compiled.wait() >= 4
    variants = {key[-1] for key in engine_of(llm).compiled.keys()}
    assert {GREEDY, Sampler.DRAW, Sampler.DRAW | Sampler.SORT, Sampler.PROCESS | Sampler.LOGPROBS} <= variants
    second = [_outputs(llm, prompts[:len(g)], g) for g in groups]  # now each call runs its own variant
    assert first == expected
    assert second == expected


def test_a_cold_cpu_engine_runs_greedy_programs_until_a_call_needs_more():
    """Where branches skip work (CPU), an engine that has not warmed up runs the greedy programs
    while its calls are greedy (a swapped-out greedy request comes back greedy), then `ALL`;
    its tokens and logprobs equal those of a warmed engine, which runs `ALL` alone."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(3, 20, size=6)]
    kwargs = dict(num_slots=4, max_seq_len=64, max_logprobs=4, seed=0)
    warmed = LLM("tiny-llama", **kwargs)
    warmed.warmup()
    cold = LLM("tiny-llama", kv_cache="paged", page_size=8, num_pages=12, preemption_mode="swap",
               host_kv_cache_bytes=1 << 24, **kwargs)
    assert not engine_of(cold).samplers.specializes
    greedy = [SamplingParams(max_tokens=30, ignore_eos=True)] * len(prompts)
    assert _outputs(cold, prompts, greedy) == _outputs(warmed, prompts, greedy)
    assert scheduler_of(cold).host.stats.swaps_in > 0  # swapped out and back in
    assert {key[-1] for key in engine_of(cold).compiled.keys()} == {GREEDY}
    mixed = [SAMPLINGS[0], SAMPLINGS[5], SAMPLINGS[2]]
    assert _outputs(cold, prompts[:3], mixed) == _outputs(warmed, prompts[:3], mixed)
    assert {key[-1] for key in engine_of(cold).compiled.keys()} == {GREEDY, ALL}
    greedy_programs = [key for key in engine_of(cold).compiled.keys() if key[-1] == GREEDY]
    assert _outputs(cold, prompts, greedy) == _outputs(warmed, prompts, greedy)  # ALL serves from now on
    assert {key[-1] for key in engine_of(cold).compiled.keys()} == {GREEDY, ALL}
    assert [key for key in engine_of(cold).compiled.keys() if key[-1] == GREEDY] == greedy_programs
    assert {key[-1] for key in engine_of(warmed).compiled.keys()} == {ALL}


def test_background_compiles_of_a_warm_engine_end():
    llm = LLM("tiny-llama", num_slots=2, max_seq_len=32, seed=0)
    engine_of(llm).samplers.specializes = True  # as on a GPU
    programs = llm.warmup()
    assert engine_of(llm).compiled.wait() == programs  # a greedy program for each program warm-up compiled
    assert sum(key[-1] == GREEDY for key in engine_of(llm).compiled.keys()) == programs
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_a_program_is_traced_for_its_engines_platform_alone():
    """The engine traces its programs for its own platform (`Ops.platform`): no
    `platform_dependent` left (the sampler's skips and the attention kernel chosen at the trace,
    not all of them traced to be chosen at lowering), and fewer equations than the program for
    any platform."""
    from cbjax.runtime.traced.step import ragged_step

    engine = Engine(abstract_model(RANDOM_PRESETS["tiny-llama"], jnp.float32),
                    EngineConfig(num_slots=2, max_seq_len=64, kv_cache="paged", page_size=16, attention="pallas",
                                 cpu_kernels="off", max_logprobs=3))
    args, static = engine.padding_arguments(16, 1)
    assert static["platform"] == "cpu"
    own = str(ragged_step.trace(*args, **static).jaxpr)
    anywhere = str(ragged_step.trace(*args, **{**static, "platform": None}).jaxpr)
    assert "platform_index" not in own and "platform_index" in anywhere
    assert len(own.splitlines()) < len(anywhere.splitlines())
