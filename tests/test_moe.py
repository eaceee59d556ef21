"""Mixtures of experts (cbjax/models/moe.py): every MoE family's greedy tokens equal transformers'
through the engine in both cache layouts, all three merge modes and under tensor parallelism; the
two ways of computing the experts agree; the capacity factor drops what it says; bad input is
refused by name."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, EngineArgs, SamplingParams
from cbjax.config import ModelConfig
from cbjax.loading import load_hf_dir, load_model
from cbjax.models import moe
from cbjax.runtime.engine import Engine
from tests.hf_models import MOE_FAMILIES, make_hf_model, save_hf_model
from tests.test_engine_parity import MAX_SEQ_LEN, hf_greedy, workload
from tests.tiers import slow, sweep
from tests.internals import scheduler_of

NUM_PROMPTS = 8
LAYOUTS = {"slots": dict(), "paged": dict(kv_cache="paged", page_size=8, num_pages=24)}
MERGE_MODES = {"prefill_first": dict(), "fused": dict(merge_mode="fused"),
               "chunked": dict(merge_mode="chunked", max_num_batched_tokens=13)}
FAMILIES = sorted(MOE_FAMILIES)


@pytest.fixture(scope="module")
def family_setup(tmp_path_factory):
    """Per family, built once: the loaded model, a workload and transformers' greedy tokens."""
    made = {}

    def get(family):
        if family not in made:
            hf = make_hf_model(family, seed=11, eos_token_id=2, bos_token_id=1)
            model = load_hf_dir(save_hf_model(hf, str(tmp_path_factory.mktemp(family))), with_tokenizer=False)
            prompts, max_tokens = workload(model.config.vocab_size)
            prompts, max_tokens = prompts[-NUM_PROMPTS:], max_tokens[-NUM_PROMPTS:]
            made[family] = model, prompts, max_tokens, [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
        return made[family]

    return get


def _generate(model, prompts, max_tokens, **options):
    llm = LLM(model, num_slots=4, max_seq_len=MAX_SEQ_LEN, **options)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens], use_tqdm=False)
    return llm, [o.token_ids for o in outputs]


PARITY = [(f, layout, mode) for f in FAMILIES for layout in LAYOUTS for mode in MERGE_MODES]


@pytest.mark.parametrize("family,layout,mode", sweep(PARITY, quick={
    ("mixtral", "slots", "prefill_first"), ("qwen2_moe", "paged", "chunked"), ("qwen3_moe", "paged", "fused"),
    ("olmoe", "slots", "chunked")}))
def test_greedy_tokens_equal_transformers(family_setup, family, layout, mode):
    model, prompts, max_tokens, expected = family_setup(family)
    _, tokens = _generate(model, prompts, max_tokens, **LAYOUTS[layout], **MERGE_MODES[mode])
    assert tokens == expected


@pytest.mark.parametrize("family,tensor_parallel", sweep(
    [(f, tp) for f in FAMILIES for tp in (2, 4)], quick={("qwen2_moe", 2)}))
def test_tensor_parallel_equals_transformers(family_setup, family, tensor_parallel):
    """Each expert split by its width over the devices (and Qwen2-MoE's shared expert like a dense MLP)."""
    model, prompts, max_tokens, expected = family_setup(family)
    _, tokens = _generate(model, prompts, max_tokens, tensor_parallel=tensor_parallel, merge_mode="chunked",
                          max_num_batched_tokens=13)
    assert tokens == expected


EXPERT_PARALLEL = [(f, ep, 1) for f in FAMILIES for ep in (2, 4, 8)] + [(f, 2, 2) for f in FAMILIES]


@pytest.mark.parametrize("family,expert_parallel,tensor_parallel", sweep(
    EXPERT_PARALLEL, quick={("mixtral", 2, 1), ("qwen3_moe", 8, 1), ("qwen2_moe", 2, 2)}))
def test_expert_parallel_equals_transformers(family_setup, family, expert_parallel, tensor_parallel):
    """The experts spread over devices, tokens moved to them and back by all-to-all
    (cbjax/runtime/scale/expert_parallel.py), beside tensor parallelism; chunked and paged (the layout
    and mode the sweep above checks on one device) alternate with the case."""
    model, prompts, max_tokens, expected = family_setup(family)
    layout = LAYOUTS["paged" if expert_parallel % 4 else "slots"]
    llm, tokens = _generate(model, prompts, max_tokens, expert_parallel=expert_parallel,
                            tensor_parallel=tensor_parallel, **layout, **MERGE_MODES["chunked"])
    assert llm.engine_info.ops.startswith(f"ExpertParallelOps(ep={expert_parallel}, tp={tensor_parallel}")
    assert llm.engine_info.num_devices == expert_parallel * tensor_parallel
    assert tokens == expected


@pytest.mark.parametrize("options,match", [
    (dict(model="tiny-qwen2-moe", expert_parallel=3), "expert_parallel=3 must divide the model's num_experts"),
    (dict(model="tiny-mixtral", expert_parallel=4, tensor_parallel=4), "needs 16 devices"),
    (dict(model="tiny-llama", expert_parallel=2), "expert_parallel=2 spreads a mixture of experts"),
    (dict(model="tiny-mixtral", expert_parallel=2, pipeline_stages=2), "expert_parallel does not combine"),
    (dict(model="tiny-mixtral", expert_parallel=2, speculative_method="draft", speculative_model="tiny-mixtral"),
     "expert_parallel"),
    (dict(model="tiny-mixtral", expert_parallel=0), "expert_parallel"),
])
def test_bad_expert_parallel_settings_are_refused_by_name(options, match):
    options = dict(options)
    with pytest.raises(ValueError, match=match):
        LLM(options.pop("model"), num_slots=2, max_seq_len=32, **options)


def test_the_link_bytes_per_layer():
    from cbjax.runtime.scale.expert_parallel import link_bytes_per_layer

    assert link_bytes_per_layer(64, 2, 4096, 1, 2) == 0
    # ep 4: 16 tokens a device, 32 pairs; two exchanges of 4 x 32 rows, 3/4 leaving; a gather of 3 x 16 rows.
    assert link_bytes_per_layer(64, 2, 4096, 4, 2) == (2 * 4 * 32 * 4096 * 3 // 4 + 3 * 16 * 4096) * 2


DENSE_FEATURES = {
    "prefix-preempt-recompute": dict(kv_cache="paged", page_size=8, num_pages=10, enable_prefix_caching=True,
                                     merge_mode="chunked", max_num_batched_tokens=13),
    "preempt-swap": dict(preemption_mode="swap", host_kv_cache_bytes=1 << 24, kv_cache="paged", page_size=8,
                         num_pages=10),
    "ngram-speculation": dict(speculative_method="ngram", speculative_length="fixed"),
    "pipeline-stages-2": dict(pipeline_stages=2),
    "disaggregated-1p1d": dict(prefill_instances=1, decode_instances=1),
    "bfloat16-reference": dict(dtype="bfloat16"),
}


@pytest.mark.parametrize("name", sweep(sorted(DENSE_FEATURES), quick={"prefix-preempt-recompute"}))
def test_what_dense_models_have_works_here_too(family_setup, name):
    """Preemption (recompute and swap) under page pressure, prefix caching, speculation, pipeline
    stages and disaggregated prefill/decode give transformers' tokens; in bf16 a batch gives each
    prompt the tokens it gets alone."""
    options = DENSE_FEATURES[name]
    model, prompts, max_tokens, expected = family_setup("mixtral")
    if options.get("dtype") == "bfloat16":  # its own reference: the same bf16 model, each prompt alone
        model = load_model(model.source, dtype="bfloat16")
        expected = [_generate(model, [p], [m])[1][0] for p, m in zip(prompts, max_tokens)]
    llm, tokens = _generate(model, prompts, max_tokens, **options)
    assert tokens == expected
    if "num_pages" in options:
        assert scheduler_of(llm).num_preemptions > 0


def test_routing_changes_compile_nothing():
    """Routing is data: after warm-up, other prompts (other experts) run the same programs."""
    llm = LLM("tiny-mixtral", num_slots=4, max_seq_len=MAX_SEQ_LEN, merge_mode="chunked", max_num_batched_tokens=16)
    llm.warmup()
    compiled = Engine.num_backend_compilations()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, size=int(n)).tolist() for n in rng.integers(1, 30, size=12)]
    llm.generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)
    assert Engine.num_backend_compilations() == compiled


def _random_layer(config: ModelConfig, seed: int):
    rng = np.random.default_rng(seed)
    e, w, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
    p = {"router": rng.normal(0, 0.5, (e, d)), "moe_w_gate": rng.normal(0, 0.1, (e, w, d)),
         "moe_w_up": rng.normal(0, 0.1, (e, w, d)), "moe_w_down": rng.normal(0, 0.1, (e, d, w))}
    return {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}


def _numpy_experts(h, p, config, keep=None):
    """Each token through its top-k experts one at a time, in numpy."""
    h, p = np.asarray(h, np.float64), {k: np.asarray(v, np.float64) for k, v in p.items()}
    logits = h @ p["router"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for i, row in enumerate(probs):
        top = np.argsort(-row, kind="stable")[:config.num_experts_per_tok]
        weights = row[top] / (row[top].sum() if config.norm_topk_prob else 1.0)
        for j, (e, wgt) in enumerate(zip(top, weights)):
            if keep is not None and not keep[i, j]:
                continue
            g, u = p["moe_w_gate"][e] @ h[i], p["moe_w_up"][e] @ h[i]
            out[i] += wgt * (p["moe_w_down"][e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("tokens", [1, 3, 24])
def test_gathered_and_grouped_experts_equal_the_numpy_layer(tokens):
    """Few pairs take the gathered path, many the grouped one: both equal the per-token loop."""
    config = load_model("tiny-qwen3-moe").config
    p = _random_layer(config, 0)
    h = jax.random.normal(jax.random.key(tokens), (tokens, config.hidden_size))
    weights, experts = moe.route(h, p["router"], config)
    for compute in (moe._gathered, moe._grouped):
        out = jax.jit(compute)(h, experts, weights, p)
        np.testing.assert_allclose(out, _numpy_experts(h, p, config), rtol=2e-4, atol=2e-5)
    out, counts = moe.moe_mlp(h[None], p, config, jnp.ones((1, tokens), bool))
    np.testing.assert_allclose(out[0], _numpy_experts(h, p, config), rtol=2e-4, atol=2e-5)
    assert int(counts.sum()) == tokens * config.num_experts_per_tok


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0, 1.5])
def test_capacity_keeps_each_experts_first_tokens(factor):
    """An expert keeps its first ceil(factor x valid tokens x k / E) valid tokens in the call's
    order; padding tokens take no place; the dropped pairs contribute nothing."""
    config = load_model("tiny-mixtral").config.replace(expert_capacity_factor=factor)
    p = _random_layer(config, 1)
    n = 40
    h = jax.random.normal(jax.random.key(1), (n, config.hidden_size))
    valid = np.arange(n) % 5 != 4
    _, experts = moe.route(h, p["router"], config)
    keep = np.asarray(moe.kept_pairs(experts, jnp.asarray(valid), config))
    capacity = int(np.ceil(factor * valid.sum() * config.num_experts_per_tok / config.num_experts))
    taken = np.zeros(config.num_experts, int)
    expected = np.zeros_like(keep)
    for i, row in enumerate(np.asarray(experts)):
        for j, e in enumerate(row):
            if valid[i] and taken[e] < capacity:
                expected[i, j], taken[e] = True, taken[e] + 1
    np.testing.assert_array_equal(keep, expected)
    out, counts = moe.moe_mlp(h[None], p, config, jnp.asarray(valid)[None])
    np.testing.assert_array_equal(counts, taken)
    reference = _numpy_experts(h, p, config, keep=expected)
    np.testing.assert_allclose(out[0][valid], reference[valid], rtol=2e-4, atol=2e-5)


def test_an_ample_capacity_changes_no_token(family_setup):
    model, prompts, max_tokens, expected = family_setup("mixtral")
    _, tokens = _generate(model, prompts, max_tokens, expert_capacity_factor=float(model.config.num_experts))
    assert tokens == expected


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "x"])
def test_a_capacity_factor_at_or_below_zero_is_refused(bad):
    with pytest.raises(ValueError, match="expert_capacity_factor"):
        EngineArgs(expert_capacity_factor=bad)
    with pytest.raises(ValueError, match="expert_capacity_factor"):
        load_model("tiny-mixtral").config.replace(expert_capacity_factor=bad if bad != "x" else -2)


def test_a_capacity_factor_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="expert_capacity_factor.*dense"):
        LLM("tiny-llama", expert_capacity_factor=1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_missing_an_experts_tensor_names_it(family, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = save_hf_model(make_hf_model(family), str(tmp_path / "ok"))
    bad = shutil.copytree(path, tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    name = next(n for n in sorted(tensors) if ".experts.1." in n and "up" in n.replace("w3", "up"))
    del tensors[name]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing expert\(s\) \[1\] of 'layers/0/moe_w_up'"):
        load_hf_dir(str(bad))


def test_config_keys_of_both_spellings_and_dense_layers():
    """The expert count as `num_experts` or `num_local_experts`; Qwen's dense layers by
    `mlp_only_layers` and `decoder_sparse_step`."""
    base = dict(model_type="qwen2_moe", vocab_size=64, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                intermediate_size=32, moe_intermediate_size=8, num_experts_per_tok=2)
    a = ModelConfig.from_hf_dict({**base, "num_experts": 4, "decoder_sparse_step": 2})
    b = ModelConfig.from_hf_dict({**base, "num_local_experts": 4, "mlp_only_layers": [0, 2]})
    assert a.num_experts == b.num_experts == 4
    assert [a.is_moe_layer(i) for i in range(4)] == [b.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf_dict({**base, "num_experts": 0})


@pytest.mark.parametrize("pairs,experts", [(1, 8), (6, 4), (40, 8), (33, 16)])
def test_the_cpu_expert_kernel_equals_the_gathered_product(pairs, experts):
    """The C++ kernel (experts.h): each pair's row times its expert, experts chosen by several
    pairs, by none, and out-of-order; widths that are not multiples of the vector lanes."""
    from cbjax.runtime.cpu import kernels

    if not kernels.available():
        pytest.skip(f"CPU kernels unavailable: {kernels.build_error()}")
    rng = np.random.default_rng(pairs)
    x = jnp.asarray(rng.normal(size=(pairs, 37)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(experts, 70, 37)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, experts, pairs), jnp.int32)
    got = jax.jit(kernels.expert_matmul_nt)(x, w, ids)
    np.testing.assert_allclose(got, jnp.einsum("pk,pnk->pn", x, w[ids]), rtol=1e-5, atol=1e-5)
    assert kernels.CPU_KERNELS.expert_dense(x, w.astype(jnp.bfloat16), ids) is None  # bf16: XLA's way


@slow  # the quick run's parity cases already run the expert kernel (cpu_kernels auto); here it is off too
def test_the_engine_with_and_without_the_cpu_kernels_agrees(family_setup):
    model, prompts, max_tokens, expected = family_setup("qwen3_moe")
    for choice in ("auto", "off"):
        _, tokens = _generate(model, prompts, max_tokens, cpu_kernels=choice)
        assert tokens == expected, choice


def test_a_calibration_of_a_dense_model_is_refused_for_a_mixture_of_experts(tmp_path):
    from cbjax.simulator import CalibratedCost, load_cost_model

    path = str(tmp_path / "cal.json")
    CalibratedCost({k: {f: 1e-3 for f in ("steps", "tokens", "attended", "kv_read", "rows")}
                    for k in ("prefill", "decode", "mixed")}).save(path)
    with pytest.raises(ValueError, match="mixture of experts"):
        load_cost_model(path, load_model("tiny-mixtral").config)


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-olmoe"])
def test_orbax_round_trip_keeps_the_experts_and_the_dense_layers(preset, tmp_path):
    from cbjax.loading import save_orbax

    model = load_model(preset, seed=3)
    save_orbax(model, str(tmp_path / "ckpt"))
    restored = load_model(str(tmp_path / "ckpt"))
    assert restored.config == model.config
    for (path, a), (_, b) in zip(jax.tree.leaves_with_path(model.params), jax.tree.leaves_with_path(restored.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_the_simulator_prices_the_experts_a_batch_reads():
    """Mixtral-8x7B's published sizes; the experts read grow with the batch as E(1 - (1 - k/E)^B) under
    uniform routing, and with a skewed measured routing fewer are read; a decode step of one
    sequence costs about what the dense model of its active parameters does; expert parallelism
    splits the experts' bytes and adds the link."""
    from cbjax.simulator import Call, RooflineCost
    from cbjax.simulator.hardware import ACCELERATORS, MODEL_SHAPES, matmul_params, weight_bytes

    mixtral, dense = MODEL_SHAPES["mixtral-8x7b"], MODEL_SHAPES["dense-12.9b"]
    assert 46.5e9 < weight_bytes(mixtral, 1) < 46.9e9 and 12.6e9 < matmul_params(mixtral) < 13.0e9
    h100 = ACCELERATORS["h100"]
    cost = RooflineCost(h100, mixtral, 1, weight_dtype="fp8")
    for b in (1, 2, 8, 64):
        assert cost.experts_read(b) == pytest.approx(8 * (1 - (1 - 2 / 8) ** b))
    skewed = RooflineCost(h100, mixtral, 1, weight_dtype="fp8", routing=[8, 4, 2, 1, 1, 1, 1, 1])
    assert skewed.experts_read(8) < cost.experts_read(8)

    def step(c, b):
        return c.seconds(Call("decode", tokens=b, attended=b * 512, kv_read=b * 512, rows=b))

    same_active = RooflineCost(h100, dense, 1, weight_dtype="fp8")
    assert step(cost, 1) == pytest.approx(step(same_active, 1), rel=0.05)
    assert step(cost, 64) > 1.5 * step(same_active, 64)
    ep = [RooflineCost(h100, mixtral, 2, expert_parallel=n) for n in (2, 8)]
    assert step(ep[1], 64) < step(ep[0], 64)
    with pytest.raises(ValueError, match="expert_parallel=3 must divide"):
        RooflineCost(h100, mixtral, 2, expert_parallel=3)
    with pytest.raises(ValueError, match="routing"):
        RooflineCost(h100, mixtral, 2, routing=[1, 2])


def test_a_simulated_engine_runs_a_mixture_of_experts_with_expert_parallel():
    from cbjax.simulator import model_for_simulation

    llm = LLM(model_for_simulation("mixtral-8x7b"), simulate="h100", expert_parallel=2, num_slots=8,
              max_seq_len=256)
    outs = llm.generate([[1] * 100] * 8, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [16] * 8 and llm.clock() > 0


ROUTING_COUNTED = {"slots": dict(), "decode-steps-3": dict(decode_steps=3),
                   "paged-chunked": dict(kv_cache="paged", page_size=8, merge_mode="chunked", max_num_batched_tokens=13)}


@pytest.mark.parametrize("name", sorted(ROUTING_COUNTED))
def test_tokens_per_expert_are_counted_in_the_stats_and_on_metrics(name):
    """Every token the model computes (prompt tokens, and each decode step's input) sends top_k
    pairs through every MoE layer: the stats count exactly those, padding none; the imbalance is
    the busiest expert over the mean; /metrics shows both."""
    from cbjax.serve.prometheus import ServerMetrics

    llm = LLM("tiny-mixtral", num_slots=4, max_seq_len=64, **ROUTING_COUNTED[name])
    prompts = [[5, 6, 7, 8]] * 3 + [list(range(3, 13))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    tokens = sum(len(p) for p in prompts) + sum(len(o.token_ids) - 1 for o in outs)
    counts = llm.stats.expert_tokens
    assert counts.shape == (2, 8) and counts.sum(axis=1).tolist() == [2 * tokens] * 2
    mean = counts.mean(axis=1)
    assert llm.load().expert_imbalance == pytest.approx(float(np.mean(counts.max(axis=1) / mean)))
    text = ServerMetrics("m").render(llm.load()).decode()
    assert f'cbjax:moe_expert_tokens{{expert="0",layer="1",model_name="m"}} {float(counts[1, 0])}' in text
    assert "cbjax:moe_expert_imbalance" in text


def test_a_dense_model_counts_no_experts():
    llm = LLM("tiny-llama", num_slots=2, max_seq_len=32)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.stats.expert_tokens is None and llm.load().expert_imbalance == 0.0


def test_the_server_streams_a_mixture_of_experts_and_shows_its_experts(tmp_path):
    """Through `python -m cbjax.serve`'s server and the openai client: streamed completions of a
    MoE equal `LLM.generate`, and /metrics counts the experts' tokens."""
    import concurrent.futures
    import urllib.request

    import openai

    from cbjax.serve import Server
    from tests.hf_models import save_chat_model

    llm = LLM(save_chat_model(str(tmp_path / "moe"), family="qwen3_moe"), num_slots=4, max_seq_len=96)
    prompts = ["Hello, world!", "Continuous batching", "Paged attention", "The lazy dog"]
    expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0),
                                             use_tqdm=False)]
    with Server(llm, "moe", port=0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def stream(prompt):
            chunks = client.completions.create(model="moe", prompt=prompt, max_tokens=10, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(stream, prompts)) == expected
        metrics = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    counted = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("cbjax:moe_expert_tokens{")]
    assert len(counted) == 2 * 16 and sum(counted) > 0
