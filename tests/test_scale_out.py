"""Scale-out on 8 host CPU devices (tests/conftest.py sets XLA_FLAGS): tensor parallel,
data-parallel replicas, pipeline stages and a 2-process jax.distributed run, each
serving transformers' greedy tokens, with every array's placement asserted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.loading import load_hf_dir
from cbjax.runtime.scale.pipeline import StageCall, bubble_fraction, stage_bounds
from cbjax.parallel.replicas import Replicas
from tests.hf_models import make_hf_model, save_hf_model
from tests.test_engine_parity import hf_greedy
from tests.tiers import slow, sweep
from tests.internals import engine_of, pages_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 10
# 8 query heads and an MLP width of 128 divide over 8 devices; 2 KV heads do not (replicated at 4 and 8).
GQA = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=3)


def _prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in rng.integers(1, 40, size=n)]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    assert len(jax.devices()) >= 8, "tests/conftest.py should have given the suite 8 host devices"
    hf = make_hf_model("llama", seed=5, eos_token_id=2, bos_token_id=1, **GQA)
    path = save_hf_model(hf, str(tmp_path_factory.mktemp("gqa")))
    model = load_hf_dir(path, with_tokenizer=False)
    prompts = _prompts(model.config.vocab_size)
    return model, path, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Biases-free, q/k norms, 4 KV heads: split over 2 and 4 devices."""
    hf = make_hf_model("qwen3", seed=6, eos_token_id=2, bos_token_id=1, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=16, intermediate_size=128)
    model = load_hf_dir(save_hf_model(hf, str(tmp_path_factory.mktemp("qwen3"))), with_tokenizer=False)
    prompts = _prompts(model.config.vocab_size, seed=1)
    return model, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def _generate(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)]


def _spec(x) -> tuple:
    """The array's partition spec padded to its rank (trailing Nones are left out otherwise)."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _assert_tensor_parallel_layout(llm, tp: int, kv_split: bool):
    engine = engine_of(llm)
    layers = engine.params["layers"][-1]
    devices = set(jax.devices()[:tp])
    for leaf in jax.tree.leaves(engine.params) + jax.tree.leaves(engine.cache) + jax.tree.leaves(engine.state):
        assert leaf.sharding.device_set == devices
    # Matrices are [out, in]: column-parallel ones split their rows, row-parallel ones their columns.
    assert _spec(layers["wq"]) == _spec(layers["w_up"]) == ("tp", None)
    assert _spec(layers["wo"]) == _spec(layers["w_down"]) == (None, "tp")
    assert _spec(layers["wk"]) == _spec(layers["wv"]) == (("tp", None) if kv_split else (None, None))
    assert engine.params["embed"].sharding.is_fully_replicated
    kv_spec = [None] * engine.cache.k[0].ndim
    if kv_split:
        kv_spec[engine.cache.head_axis] = "tp"
    assert len(engine.cache.k) == len(engine.cache.v) == engine.model.config.num_layers
    assert all(_spec(a) == tuple(kv_spec) for a in engine.cache.k + engine.cache.v)
    assert all(a.sharding == engine.cache.k[0].sharding for a in engine.cache.k + engine.cache.v)
    if kv_split:  # each device holds its share of the KV heads
        shard = engine.cache.k[0].addressable_shards[0].data
        assert shard.shape[engine.cache.head_axis] == engine.model.config.num_kv_heads // tp
    assert engine.cache.lengths.sharding.is_fully_replicated
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(engine.state))


@pytest.mark.parametrize("tp,kv_cache", sweep([(2, "slots"), (4, "paged"), (8, "slots")], quick={(2, "slots")}))
def test_tensor_parallel_gqa_matches_transformers(gqa, tp, kv_cache):
    model, _, prompts, expected = gqa
    llm = LLM(model, tensor_parallel=tp, num_slots=4, max_seq_len=64, kv_cache=kv_cache, page_size=8)
    if tp == 4:  # the compile bound holds: after warm-up nothing new is traced (the cache keeps its layout)
        llm.warmup()
    before = engine_of(llm).num_compilations()
    assert _generate(llm, prompts) == expected
    _assert_tensor_parallel_layout(llm, tp, kv_split=tp <= 2)
    assert _generate(llm, prompts[::-1]) == expected[::-1]
    _assert_tensor_parallel_layout(llm, tp, kv_split=tp <= 2)
    if tp == 4:
        assert engine_of(llm).num_compilations() == before


@pytest.mark.parametrize("tp", sweep([2, 4], quick={2}))
def test_tensor_parallel_qwen3_chunked_mixed(qwen3, tp):
    model, prompts, expected = qwen3
    llm = LLM(model, tensor_parallel=tp, num_slots=4, max_seq_len=64, merge_mode="chunked",
              max_num_batched_tokens=13)
    assert _generate(llm, prompts) == expected
    _assert_tensor_parallel_layout(llm, tp, kv_split=True)


def test_tensor_parallel_rejects_what_does_not_divide(gqa):
    model = gqa[0]
    with pytest.raises(ValueError, match="num_heads"):
        LLM(model, tensor_parallel=3, num_slots=2, max_seq_len=32)
    with pytest.raises(ValueError, match="devices"):
        LLM(model, tensor_parallel=16, num_slots=2, max_seq_len=32)
    with pytest.raises(ValueError, match="tensor_parallel"):
        LLM(model, tensor_parallel=0, num_slots=2, max_seq_len=32)


@pytest.mark.parametrize("dp,tp,routing", sweep([(2, 1, "round_robin"), (2, 2, "least_loaded")],
                                                 quick={(2, 1, "round_robin")}))
def test_replicas_match_transformers(gqa, dp, tp, routing):
    model, _, prompts, expected = gqa
    front = Replicas(model, data_parallel=dp, tensor_parallel=tp, routing=routing, num_slots=2, max_seq_len=64,
                     kv_cache="paged", page_size=8, enable_prefix_caching=True)
    try:
        assert [o.token_ids for o in front.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))] == expected
        groups = [engine_of(r).params["embed"].sharding.device_set for r in front.replicas]
        assert all(len(g) == tp for g in groups)
        assert len(set().union(*groups)) == dp * tp  # disjoint device groups
        for r, g in zip(front.replicas, groups):
            assert all(leaf.sharding.device_set == g for leaf in jax.tree.leaves(engine_of(r).cache))
        assert sum(front.routed) == len(prompts)
        if routing == "round_robin":
            assert front.routed == [len(prompts) // dp] * dp
        assert not front.has_unfinished_requests() and not front._owner
    finally:
        front.close()


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(gqa):
    model = gqa[0]
    rng = np.random.default_rng(3)
    systems = [rng.integers(3, 150, size=16).tolist() for _ in range(2)]
    prompts = [systems[i % 2] + rng.integers(3, 150, size=4).tolist() for i in range(8)]
    front = Replicas(model, data_parallel=4, routing="prefix_affinity", num_slots=4, max_seq_len=64,
                     kv_cache="paged", page_size=8, enable_prefix_caching=True, affinity_slack=100)
    try:
        owners = []
        for batch in (prompts[:2], prompts[2:]):  # the first of each prefix writes its pages, then the rest
            ids = [front.add_request(p, SamplingParams(max_tokens=2)) for p in batch]
            owners += [front._owner[i] for i in ids]
            while front.has_unfinished_requests():
                front.step()
        assert owners[0::2] == [owners[0]] * 4 and owners[1::2] == [owners[1]] * 4
        hits = sum(pages_of(r).stats.hits for r in front.replicas)
        assert hits == 2 * 3 * 2  # each prefix's 2 full pages, found by the 3 requests after its first
        # least_loaded spreads the same requests; a bad one is refused and harms nothing
        other = Replicas(model, data_parallel=2, routing="least_loaded", num_slots=4, max_seq_len=64,
                         parallel_step=False)
        outs = other.generate([prompts[0], [], prompts[1]], SamplingParams(max_tokens=2))
        assert outs[1].finish_reason == "error" and "empty" in outs[1].error
        assert [len(o.token_ids) for o in (outs[0], outs[2])] == [2, 2]
        assert other.routed == [1, 1]
    finally:
        front.close()
    with pytest.raises(ValueError, match="routing"):
        Replicas(model, data_parallel=2, routing="random")
    with pytest.raises(ValueError, match="devices"):
        Replicas(model, data_parallel=4, tensor_parallel=4)


@pytest.mark.parametrize("stages,micro_batches,decode_steps,policy", sweep([
    (2, 1, 1, "continuous"), (2, 2, 3, "continuous"), (2, 4, 2, "static"), (3, 2, 1, "continuous")],
    quick={(2, 1, 1, "continuous"), (2, 4, 2, "static")}))
def test_pipeline_stages_match_transformers(gqa, stages, micro_batches, decode_steps, policy):
    model, _, prompts, expected = gqa
    llm = LLM(model, pipeline_stages=stages, micro_batches=micro_batches, decode_steps=decode_steps, policy=policy,
              num_slots=4, max_seq_len=64, max_prefill_tokens=16 if stages == 3 else None)
    assert _generate(llm, prompts) == expected
    engine = engine_of(llm)
    bounds = stage_bounds(model.config.num_layers, stages)
    for s, device in enumerate(jax.devices()[:stages]):
        assert all(leaf.sharding.device_set == {device} for leaf in jax.tree.leaves(engine.stage_params[s]))
        assert all(a.sharding.device_set == {device} for a in engine.caches[s].k + engine.caches[s].v)
        assert len(engine.caches[s].k) == len(engine.stage_params[s]["layers"]) == bounds[s + 1] - bounds[s]
    assert "embed" in engine.stage_params[0] and "lm_head" in engine.stage_params[-1]
    assert "lm_head" not in engine.stage_params[0] and "embed" not in engine.stage_params[-1]
    assert engine.state.tokens.sharding.device_set == {jax.devices()[stages - 1]}
    decodes = [c for r in engine.call_log for c in r if c.kind == "decode"]
    assert {c.chain for c in decodes} == {("decode", g) for g in range(micro_batches)}
    assert {c.rows for c in decodes} == {4 // micro_batches}


def test_pipeline_rejects_what_it_cannot_run(gqa):
    model = gqa[0]
    with pytest.raises(ValueError, match="micro_batches"):
        LLM(model, pipeline_stages=2, micro_batches=3, num_slots=4, max_seq_len=32)
    with pytest.raises(ValueError, match="slot cache"):
        LLM(model, pipeline_stages=2, kv_cache="paged", num_slots=4, max_seq_len=32, page_size=8)
    with pytest.raises(ValueError, match="layers"):
        LLM(model, pipeline_stages=4, num_slots=4, max_seq_len=32)
    with pytest.raises(ValueError, match="combine"):
        LLM(model, pipeline_stages=2, tensor_parallel=2, num_slots=4, max_seq_len=32)


def _decode_round(stages: int, groups: int, steps: int) -> list[StageCall]:
    return [StageCall(s, ("decode", g), "decode", 1, 1, 16)
            for _ in range(steps) for g in range(groups) for s in range(stages)]


@pytest.mark.parametrize("stages,groups,steps", [(2, 1, 1), (2, 2, 4), (4, 4, 3), (4, 8, 2), (3, 1, 5)])
def test_bubble_replay_matches_the_textbook_formula(stages, groups, steps):
    """Equal unit-cost calls: with groups >= stages the pipeline fills once per round,
    bubble (S-1)/(M*k + S-1); with one group only one stage ever works, 1 - 1/S."""
    result = bubble_fraction([_decode_round(stages, groups, steps)], lambda c: 1.0, stages)
    if groups >= stages:
        expected = (stages - 1) / (groups * steps + stages - 1)
    else:
        assert groups == 1
        expected = 1 - 1 / stages
    assert result["bubble_fraction"] == pytest.approx(expected)
    assert result["busy_s"] == [groups * steps] * stages
    # Two rounds pay the fill twice (the host syncs in between); a prefill before them delays the decodes.
    two = bubble_fraction([_decode_round(stages, groups, steps)] * 2, lambda c: 1.0, stages)
    assert two["makespan_s"] == pytest.approx(2 * result["makespan_s"])
    prefill = [StageCall(s, ("prefill", 0), "prefill", 1, 16, 16) for s in range(stages)]
    with_prefill = bubble_fraction([prefill + _decode_round(stages, groups, steps)], lambda c: 1.0, stages)
    assert with_prefill["makespan_s"] == pytest.approx(result["makespan_s"] + stages)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@slow
def test_two_processes_serve_through_jax_distributed(gqa, tmp_path):
    """Two CPU processes, one device each, joined by jax.distributed (gloo): the model is
    tensor-parallel across them and both processes produce transformers' greedy tokens."""
    _, path, prompts, expected = gqa
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    port = _free_port()
    out = str(tmp_path / "out.{process}.json")
    args = [sys.executable, "-m", "experiments", "generate", f"--model={path}",
            f"--max_tokens={MAX_TOKENS}", "--max_seq_len=64", "--num_slots=4", "--tensor_parallel=2",
            "--kv_cache=paged", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
            "--local_device_count=1", "--nowarmup", f"--output_json={out}"]
    args += [f"--prompt_ids={','.join(map(str, p))}" for p in prompts[:4]]
    procs = [subprocess.Popen(args + [f"--process_id={i}"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, logs[i][-3000:]
        with open(out.replace("{process}", str(i))) as f:
            result = json.load(f)
        assert (result["process"], result["num_processes"], result["devices"]) == (i, 2, 2)
        assert [r["token_ids"] for r in result["results"]] == expected[:4]
