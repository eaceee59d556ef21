"""Many LoRA adapters in one batch: token-exact with transformers + PEFT, a mixed batch equal to
each request alone in every layout, adapters kept across preemption and swap, no compiles while
adapters load and mix, and bad adapters refused by name with nothing else disturbed."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cbjax import LLM, SamplingParams
from cbjax.loading import load_model
from cbjax.loading.peft import read_adapter
from cbjax.runtime.engine import Engine
from tests.hf_models import make_hf_model, save_hf_model
from tests.internals import pages_of, scheduler_of
from tests.lora_adapters import edit_config, family_adapters, greedy, make_adapter
from tests.tiers import slow, sweep

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int = 0, lengths=(5, 13)) -> list[list[int]]:
    """Random prompts, each ending in a repeat of its first tokens (so n-gram speculation proposes)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 150, size=int(rng.integers(*lengths))).tolist() for _ in range(n)]
    return [p + p[:3] for p in prompts]


def _llm(family: str, count: int, **options) -> LLM:
    base, _, adapters = family_adapters(family, count)
    options = dict(num_slots=4, max_seq_len=64, max_loras=count, max_lora_rank=8) | options
    llm = LLM(base, enable_lora=True, **options)
    for i, (path, _) in enumerate(adapters):
        llm.load_lora(f"a{i}", path)
    return llm


@pytest.mark.parametrize("family", sweep(["llama", "mistral", "qwen2", "qwen3", "llama-tied-bias"],
                                         quick={"llama", "qwen3"}))
def test_greedy_tokens_equal_transformers_with_peft(family):
    """Each request's greedy tokens with its adapter (q/v rank 4; all seven projections rank 8 under
    rsLoRA) equal transformers + PEFT's, the base model's beside them in the same batch."""
    _, base, adapters = family_adapters(family, 2)
    llm = _llm(family, 2)
    prompts = _prompts(6, seed=1)
    names = [None, "a0", "a1", "a1", "a0", None]
    sampling = SamplingParams(max_tokens=8, temperature=0)  # up to EOS, as transformers' generate
    outs = llm.generate(prompts, sampling, lora=names, use_tqdm=False)
    for prompt, name, out in zip(prompts, names, outs):
        reference = base if name is None else adapters[int(name[1])][1]
        assert out.token_ids == greedy(reference, prompt, sampling.max_tokens), (name, prompt)


LAYOUTS = {
    "slots": dict(),
    "paged-prefix": dict(kv_cache="paged", page_size=8, enable_prefix_caching=True),
    "chunked": dict(merge_mode="chunked", max_num_batched_tokens=13),
    "tensor-parallel-2": dict(tensor_parallel=2),
    "paged-tensor-parallel-2": dict(kv_cache="paged", page_size=8, tensor_parallel=2),
    "paged-pallas": dict(kv_cache="paged", page_size=8, attention="pallas"),
    # Beside a quantized base and speculation (verify rows carry their request's adapter).
    "int8-ngram": dict(quantization="int8", speculative_method="ngram", num_speculative_tokens=3,
                       speculative_length="fixed"),
}


@pytest.mark.parametrize("layout", sweep(LAYOUTS, quick={"paged-prefix", "tensor-parallel-2", "int8-ngram"}))
def test_a_batch_mixing_four_adapters_and_the_base_gives_each_request_its_tokens_alone(layout):
    llm = _llm("llama", 4, **LAYOUTS[layout])
    prompts = _prompts(10, seed=2)
    names = [None, "a0", "a1", "a2", "a3", "a0", None, "a3", "a1", "a2"]
    together = llm.generate(prompts, GREEDY, lora=names, use_tqdm=False)
    for prompt, name, out in zip(prompts, names, together):
        alone = llm.generate([prompt], GREEDY, lora=name, use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids, (name, prompt)
    # The adapters change the tokens (a test that would pass with every adapter ignored proves nothing).
    assert len({tuple(together[i].token_ids) for i in (1, 2, 3, 4)}) > 1


@pytest.mark.parametrize("mode", sweep(["recompute", "swap"], quick={"swap"}))
def test_preemption_and_swap_keep_each_requests_adapter(mode):
    """Few pages force preemptions; each request resumes with its own adapter (recomputing its
    prompt under it, or its KV and state swapped back)."""
    swap = dict(preemption_mode="swap", host_kv_cache_bytes=1 << 24) if mode == "swap" else {}
    llm = _llm("llama", 4, kv_cache="paged", page_size=8, num_pages=12, decode_steps=2, **swap)
    prompts = _prompts(8, seed=3, lengths=(14, 20))
    sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    names = ["a0", "a1", None, "a2", "a3", "a1", "a0", None]
    together = llm.generate(prompts, sampling, lora=names, use_tqdm=False)
    assert scheduler_of(llm).num_preemptions > 0
    for prompt, name, out in zip(prompts, names, together):
        assert out.token_ids == llm.generate([prompt], sampling, lora=name, use_tqdm=False)[0].token_ids


def test_loading_unloading_and_mixing_adapters_compiles_nothing_after_warmup(tmp_path):
    base, _, adapters = family_adapters("llama", 4)
    llm = LLM(base, enable_lora=True, num_slots=4, max_seq_len=64, max_loras=2, max_lora_rank=8,
              kv_cache="paged", page_size=8)
    llm.warmup()
    compiled = Engine.num_backend_compilations()
    prompts = _prompts(12, seed=4)
    for i, (path, _) in enumerate(adapters):
        llm.load_lora(f"a{i}", path)
    # Four adapters through two device slots: loads, evictions and mixes in every round.
    names = ["a0", "a1", "a2", "a3", None, "a2", "a0", "a3", "a1", None, "a3", "a2"]
    outs = llm.generate(prompts, GREEDY, lora=names, use_tqdm=False)
    llm.unload_lora("a1")
    llm.load_lora("a1-again", adapters[1][0])
    again = llm.generate(prompts[1:2], GREEDY, lora="a1-again", use_tqdm=False)[0]
    assert again.token_ids == outs[1].token_ids
    assert Engine.num_backend_compilations() == compiled, "adapters compiled a program after warm-up"
    counters = scheduler_of(llm).adapters.counters
    assert counters.loads >= 5 and counters.hits > 0


def test_prefix_cache_shares_no_kv_across_adapters():
    llm = _llm("llama", 2, kv_cache="paged", page_size=8, enable_prefix_caching=True)
    prompt = _prompts(1, seed=5, lengths=(30, 31))[0]
    first = llm.generate([prompt], GREEDY, lora="a0", use_tqdm=False)[0]
    hits = pages_of(llm).stats.hits
    other = llm.generate([prompt], GREEDY, lora="a1", use_tqdm=False)[0]
    assert pages_of(llm).stats.hits == hits, "a prompt under another adapter reused cached pages"
    same = llm.generate([prompt], GREEDY, lora="a0", use_tqdm=False)[0]
    assert pages_of(llm).stats.hits > hits and same.token_ids == first.token_ids
    assert other.token_ids == llm.generate([prompt], GREEDY, lora="a1", use_tqdm=False)[0].token_ids


def test_a_cold_adapter_waits_for_a_slot_and_is_not_starved():
    """One device slot, a stream of requests for a warm adapter and one for a cold one queued
    early: the cold one runs after at most `lora_max_bypass` later requests pass it."""
    llm = _llm("llama", 2, max_loras=1, lora_max_bypass=2, num_slots=2)
    prompts = _prompts(9, seed=6)
    ids = [llm.add_request(prompts[0], GREEDY, lora="a0")]
    llm.step()  # a0 takes the slot
    ids.append(llm.add_request(prompts[1], GREEDY, lora="a1"))  # cold: waits
    ids += [llm.add_request(p, GREEDY, lora="a0") for p in prompts[2:]]
    order = [o.request_id for o in llm.run_until_done()]
    assert order.index(ids[1]) < len(order) - 3, f"the cold adapter's request finished {order.index(ids[1])}th"
    counters = scheduler_of(llm).adapters.counters
    assert counters.waits >= 1 and counters.loads >= 2


# ------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """An engine with one good adapter and the base model's reference output, to check after each
    refusal that nothing else was disturbed."""
    llm = _llm("llama", 1, max_lora_rank=4, max_loras=2)
    prompt = _prompts(1, seed=7)[0]
    expected = {name: llm.generate([prompt], GREEDY, lora=name, use_tqdm=False)[0].token_ids for name in (None, "a0")}
    return llm, prompt, expected, tmp_path_factory.mktemp("bad")


def _undisturbed(llm, prompt, expected):
    for name, tokens in expected.items():
        assert llm.generate([prompt], GREEDY, lora=name, use_tqdm=False)[0].token_ids == tokens


def _bad_adapter(root, name: str, **overrides) -> str:
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        make_adapter("llama", 9, path, ["q_proj", "v_proj"], rank=4, **overrides)
    return path


@pytest.mark.parametrize("case, message", [
    ("rank", "rank 8 exceeds this engine's max_lora_rank=4"),
    ("another-base", "made for another base"),
    ("missing", "no adapter_model.safetensors"),
    ("corrupt", "not a readable safetensors"),
    ("no-config", "no adapter_config.json"),
    ("dora", "use_dora"),
    ("modules-to-save", "modules_to_save"),
    ("bias", "bias"),
    ("rank-pattern", "rank_pattern"),
    ("layers", "layers_to_transform"),
])
def test_a_bad_adapter_is_refused_by_name_and_disturbs_nothing(guarded, case, message):
    llm, prompt, expected, root = guarded
    running = llm.add_request(prompt, GREEDY, lora="a0")  # in flight while the bad one is refused
    if case == "rank":
        path = os.path.join(root, "rank8")
        if not os.path.isdir(path):
            make_adapter("llama", 9, path, ["q_proj"], rank=8)
    elif case == "another-base":
        path = _bad_adapter(root, "wide", hidden_size=96)
    else:
        path = shutil.copytree(_bad_adapter(root, "good"), os.path.join(root, case), dirs_exist_ok=True)
        weights = os.path.join(path, "adapter_model.safetensors")
        if case == "missing":
            os.remove(weights)
        elif case == "corrupt":
            with open(weights, "wb") as f:
                f.write(b"\x00garbage" * 10)
        elif case == "no-config":
            os.remove(os.path.join(path, "adapter_config.json"))
        else:
            edit_config(path, **{"dora": dict(use_dora=True), "modules-to-save": dict(modules_to_save=["lm_head"]),
                                 "bias": dict(bias="all"), "rank-pattern": dict(rank_pattern={"q_proj": 2}),
                                 "layers": dict(layers_to_transform=[0])}[case])
    with pytest.raises(ValueError, match="LoRA adapter 'bad'") as err:
        llm.load_lora("bad", path)
    assert message in str(err.value)
    assert "bad" not in llm.lora_adapters()
    outputs = {o.request_id: o for o in llm.run_until_done()}
    assert outputs[running].token_ids == expected["a0"]
    _undisturbed(llm, prompt, expected)


def test_target_modules_the_family_lacks_are_refused_by_name(tmp_path):
    path = str(tmp_path / "gpt2")
    make_adapter("gpt2", 0, path, ["c_attn"], rank=4)
    base_dir = str(tmp_path / "gpt2-base")
    save_hf_model(make_hf_model("gpt2"), base_dir)
    with pytest.raises(ValueError, match="GPT-2's fused Conv1D projections"):
        LLM(base_dir, enable_lora=True, num_slots=2, max_seq_len=32)
    with pytest.raises(ValueError, match="LoRA adapter 'g'.*c_attn.*GPT-2"):
        read_adapter("g", path, load_model(base_dir, with_tokenizer=False).config, max_rank=8)
    moe_base, moe_adapter = str(tmp_path / "moe-base"), str(tmp_path / "moe-mlp")
    save_hf_model(make_hf_model("qwen3_moe"), moe_base)
    make_adapter("qwen3_moe", 0, moe_adapter, ["q_proj"], rank=4)
    weights = os.path.join(moe_adapter, "adapter_model.safetensors")  # PEFT itself refuses fused experts:
    tensors = load_file(weights)  # an adapter on a dense MLP projection, written by hand
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = np.zeros((4, 64), np.float32)
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = np.zeros((96, 4), np.float32)
    save_file(tensors, weights)
    llm = LLM(moe_base, enable_lora=True, num_slots=2, max_seq_len=32, lora_target_modules="q_proj,v_proj")
    with pytest.raises(ValueError, match="LoRA adapter 'm'.*gate_proj"):
        llm.load_lora("m", moe_adapter)
    # An engine whose pool leaves a module out refuses an adapter on it, by name.
    llama_base, _, adapters = family_adapters("llama", 2)
    llm = LLM(llama_base, enable_lora=True, num_slots=2, max_seq_len=32, lora_target_modules="q_proj,v_proj",
              max_lora_rank=8)
    llm.load_lora("qv", adapters[0][0])
    with pytest.raises(ValueError, match="LoRA adapter 'all'.*outside this engine's lora_target_modules"):
        llm.load_lora("all", adapters[1][0])


def test_unloading_an_adapter_in_use_is_refused(guarded):
    llm, prompt, expected, _ = guarded
    rid = llm.add_request(prompt, GREEDY, lora="a0")
    with pytest.raises(ValueError, match="LoRA adapter 'a0' is in use by 1 request"):
        llm.unload_lora("a0")
    outputs = {o.request_id: o for o in llm.run_until_done()}
    assert outputs[rid].token_ids == expected["a0"]
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        llm.unload_lora("nope")
    with pytest.raises(ValueError, match="LoRA adapter 'nope' is not loaded"):
        llm.add_request(prompt, GREEDY, lora="nope")
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora("a0", family_adapters("llama", 1)[2][0][0])
    _undisturbed(llm, prompt, expected)


def test_lora_without_enable_lora_is_refused():
    base, _, adapters = family_adapters("llama", 1)
    llm = LLM(base, num_slots=2, max_seq_len=32)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.add_request([1, 2, 3], GREEDY, lora="a0")
    with pytest.raises(ValueError, match="enable_lora"):
        llm.load_lora("a0", adapters[0][0])
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LLM(base, num_slots=2, max_seq_len=32, lora_modules=f"a0={adapters[0][0]}")
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids


@slow
def test_lora_modules_load_at_start_and_generate_takes_one_name_per_prompt():
    base, _, adapters = family_adapters("llama", 2)
    llm = LLM(base, enable_lora=True, num_slots=2, max_seq_len=64, max_lora_rank=8,
              lora_modules=",".join(f"x{i}={path}" for i, (path, _) in enumerate(adapters)))
    assert llm.lora_adapters() == ["x0", "x1"]
    with pytest.raises(ValueError, match="one of those per prompt"):
        llm.generate([[1, 2], [3, 4]], GREEDY, lora=["x0"], use_tqdm=False)
    outs = llm.generate([[1, 2, 3], [1, 2, 3]], GREEDY, lora=["x0", "x1"], use_tqdm=False)
    assert [o.token_ids for o in outs] == [llm.generate([[1, 2, 3]], GREEDY, lora=name, use_tqdm=False)[0].token_ids
                                           for name in ("x0", "x1")]


def test_the_cpu_kernel_adds_each_rows_adapter_as_the_xla_gather_does():
    """`cbjax_lora_delta` (lora.h) against XLA's gather (`Ops.lora_delta`, the reference): rows of
    the base slot 0 get zeros, the others their own adapter, at any layer of the stacked pool."""
    import jax
    import jax.numpy as jnp

    from cbjax.models.ops import XLA
    from cbjax.runtime.cpu import kernels

    if not kernels.available():
        pytest.skip("no C++ compiler: the CPU kernels are not built")
    rng = np.random.default_rng(0)
    layers, slots, rank, fan_in, fan_out, rows = 3, 5, 8, 72, 40, 19
    a = jnp.asarray(rng.normal(size=(layers, slots, rank, fan_in)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(layers, slots, fan_out, rank)), jnp.float32)
    scale = jnp.asarray([0.0, 2.0, 0.5, 1.5, 3.0], jnp.float32)
    x = jnp.asarray(rng.normal(size=(rows, fan_in)), jnp.float32)
    which = jnp.asarray(rng.integers(0, slots, size=rows), jnp.int32)
    for layer in range(layers):
        got = jax.jit(lambda *args: kernels.CPU_KERNELS.lora_delta(*args, layer))(x, a, b, scale, which)
        want = jax.jit(lambda *args: XLA.lora_delta(*args, layer))(x, a, b, scale, which)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-4)
        assert not np.asarray(got)[np.asarray(which) == 0].any()


def test_the_simulator_charges_the_adapters_reads_and_loads():
    """A simulated H100 serving synthetic adapters (no weights): every request finishes through four
    device slots, each load is counted, and the same workload takes longer than on one merged
    adapter (the adapters' bytes read each pass, their loads over the host link)."""
    sampling = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = [[1] * 64] * 48

    def run(lora: bool):
        options = dict(enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=16,
                       lora_target_modules="q_proj,k_proj,v_proj,o_proj") if lora else {}
        llm = LLM("llama2-7b", simulate="h100", dtype="float16", num_slots=16, max_seq_len=256, **options)
        names = None
        if lora:
            for i in range(16):
                llm.load_lora(f"s{i}", "synthetic:16:q_proj+k_proj+v_proj+o_proj")
            names = [f"s{i % 16}" for i in range(len(prompts))]
        start = llm.clock()
        outs = llm.generate(prompts, sampling, lora=names, use_tqdm=False)
        assert all(len(o.token_ids) == 32 for o in outs)
        return llm.clock() - start, llm.load()

    with_lora, load = run(True)
    merged, _ = run(False)
    assert load.lora_loads >= 16 and with_lora > merged
    real = LLM(family_adapters("llama", 1)[0], enable_lora=True, num_slots=2, max_seq_len=32)
    with pytest.raises(ValueError, match="LoRA adapter 'x': synthetic adapters"):
        real.load_lora("x", "synthetic:8:q_proj")


def test_an_adapter_gone_from_disk_fails_its_requests_alone(tmp_path):
    """Host memory holds one adapter: the other is read back from disk when a request needs it. Its
    files deleted meanwhile, its requests finish with the error naming it; the others run."""
    base, _, adapters = family_adapters("llama", 2)
    llm = LLM(base, enable_lora=True, num_slots=2, max_seq_len=64, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    first = shutil.copytree(adapters[0][0], tmp_path / "first")
    llm.load_lora("first", str(first))
    llm.load_lora("second", adapters[1][0])  # host memory now holds "second" alone
    shutil.rmtree(first)
    prompt = _prompts(1, seed=8)[0]
    names = ["first", "second", None, "first"]
    outs = llm.generate([prompt] * 4, GREEDY, lora=names, use_tqdm=False)
    for name, out in zip(names, outs):
        if name == "first":
            assert out.finish_reason == "error" and "LoRA adapter 'first'" in out.error, out
        else:
            assert out.token_ids == llm.generate([prompt], GREEDY, lora=name, use_tqdm=False)[0].token_ids
